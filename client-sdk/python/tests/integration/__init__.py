"""The SDK against real cairn processes (issue 36): daemons, a coordinator and banks started
by the tests from the built binaries (``CAIRN_BIN_DIR``, default ``<repo>/target/debug``).

A package (unlike ``tests/unit``), so that its modules (``integration.conftest``,
``integration.cluster``) never clash with the unit tests' when both directories are checked
or collected together.
"""
