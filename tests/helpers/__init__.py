"""Helpers shared by tests of several layers (the target suites: zoo compile, fresh-process reload)."""
