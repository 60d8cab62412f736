"""Test-and-measure code of ultrafast, kept out of the product package `ultrafast`.

`bench/` (`ultrafast bench`), `loadtest/` (`ultrafast loadtest`) and `cluster/` (the cluster's
bench, relay timers, fleet simulator and child-process runner), plus the child-process fixtures
the tests use (`bench/server_process.py`, `bench/redis_server.py`). The product never imports
this package (`tests/unit/test_layers.py`); the CLI reaches a suite lazily, by module name.
"""
