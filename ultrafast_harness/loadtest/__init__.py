"""`ultrafast loadtest`: load scenarios (L*) and fault injections (F*) of docs/RELIABILITY.md 7b/7c
against the real server on loopback, each followed by the "nothing lost" checks."""
