from tests.runtime.conftest import full_spec, manual  # noqa: F401  (fixtures)
