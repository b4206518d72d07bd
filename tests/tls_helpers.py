"""Moved to tests/helpers/tls.py (issue #17); this name stays so that existing
`from tests.tls_helpers import ...` lines keep working.  New code: import from tests.helpers.

The old name is made an alias of the same module object (not a copy of its names),
so monkeypatching `tests.tls_helpers.X` still reaches the code that uses it."""
import sys

from tests.helpers import tls as _moved

sys.modules[__name__] = _moved
