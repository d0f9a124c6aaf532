"""What several test files share: harnesses and constants, no tests (imported as `helpers.x`,
`tests/` being on sys.path through tests/conftest.py)."""
