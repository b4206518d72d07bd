"""Moved to tests/helpers/servers.py (issue #17); this name stays so that existing
`from tests.servers import ...` lines keep working.  New code: import from tests.helpers.

The old name is made an alias of the same module object (not a copy of its names),
so monkeypatching `tests.servers.X` still reaches the code that uses it."""
import sys

from tests.helpers import servers as _moved

sys.modules[__name__] = _moved
