"""A tiny HTTP server with the rollout server's launch flags and /health, for the launch tests.

    GSPO_SERVER_CMD="python tests/launch_toy_server.py" launch/slurm/submit.sh ...

It checks what the launchers must get right about servers (flags, ports, reachability from the
trainer's nodes, being stopped at the end) in a fraction of a second and a few MB, where a real
SGLang server takes ~30 s and ~2 GB on these 2-core machines. It answers GET /health with 200 and
GET /info with its flags and host as JSON; it writes a line to stdout when it starts and stops.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    args, extra = parser.parse_known_args()
    if not os.path.isdir(args.model_path):
        raise SystemExit(f"--model-path {args.model_path} is not a directory")
    info = {"model_path": args.model_path, "port": args.port, "extra": extra,
            "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            if self.path not in ("/health", "/info"):
                self.send_error(404)
                return
            body = json.dumps(info).encode() if self.path == "/info" else b"ok"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *a):
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: (print("toy server: SIGTERM, stopping", flush=True),
                                              sys.exit(0)))
    print(f"toy server: listening on {args.host}:{args.port} for {info['node']}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
