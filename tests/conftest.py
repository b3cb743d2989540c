import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Tests import the project from the repository (editable install) and the helpers beside them.
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

# Session-scoped real SGLang servers shared by every rollout test module (one instance each).
from fixtures_servers import moe_server, qwen3_server  # noqa: E402,F401
