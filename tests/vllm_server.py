"""Moved to tests/helpers/vllm_server.py (issue #17); this name stays so that existing
`from tests.vllm_server import ...` lines keep working.  New code: import from tests.helpers.

The old name is made an alias of the same module object (not a copy of its names),
so monkeypatching `tests.vllm_server.X` still reaches the code that uses it."""
import sys

from tests.helpers import vllm_server as _moved

sys.modules[__name__] = _moved
