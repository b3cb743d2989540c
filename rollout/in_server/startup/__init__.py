"""Start-up patches for SGLang servers that hold on every device (sitecustomize.py says which).

`rollout.servers.launch` puts this directory first on a server child's PYTHONPATH when the server
returns routed experts; nothing in this project imports it otherwise.
"""
from pathlib import Path

STARTUP_DIR = Path(__file__).resolve().parent
