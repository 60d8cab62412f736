"""Style rule 1: core/, request.py and the session store (server/sessions/) never import torch,
nor does the engine loop (engine/ but its draft model) or the fake executor (checked in a clean
interpreter)."""

import subprocess
import sys

CODE = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == 'torch' or name.startswith('torch.'):
            raise ImportError('torch is blocked in this test')
sys.meta_path.insert(0, Block())
# the engine loop too: only the executors and sampling/ (and the draft model) touch tensors
import ultrafast.engine.thread, ultrafast.engine.core, ultrafast.engine.speculation
import ultrafast.engine.step_costs, ultrafast.executors.fake_exec
import ultrafast.request, ultrafast.core.types, ultrafast.core.kv_pool, ultrafast.core.scheduler
import ultrafast.engine.read_api, ultrafast.kvcache.manager, ultrafast.kvcache.disk
import ultrafast.kvcache.redis_tier
import ultrafast.server.sessions.store, ultrafast.server.sessions.sqlite
import ultrafast.server.sessions.redis, ultrafast.server.sessions.backends
assert 'torch' not in sys.modules
print('ok')
"""


def test_core_imports_without_torch():
    done = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
