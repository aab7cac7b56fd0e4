import pytest

# The shared checks in recovery.py are asserts: show their operands as a test's would.
pytest.register_assert_rewrite("tests.crash.recovery")
