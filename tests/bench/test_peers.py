"""``bench.peers.LlamaServer``, the llama-server client the llama.cpp peer and the structured-output
suite share, against a stand-in server: an executable named ``llama-server`` that answers
``/health`` and ``/completion`` the way llama.cpp's does (the real one is measured, never tested)."""
from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from specserve.bench.peers import LlamaServer

STAND_IN = r'''
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
with open(args[args.index("-m") + 1] + ".argv", "w") as f:
    json.dump(args, f)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["n_predict"]
        tokens = [t + 1 for t in body["prompt"]][:n]          # "generates" each prompt id plus one
        answer = {"content": "x" * len(tokens), "tokens_predicted": len(tokens)}
        if body.get("return_tokens") and not body.get("old_server"):
            answer["tokens"] = tokens
        self._send(answer)


HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.fixture
def stand_in(tmp_path):
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!{sys.executable}\n{STAND_IN}")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"")
    return str(tmp_path), str(model)


def test_completions_in_order_over_the_slots(stand_in):
    bin_dir, model = stand_in
    server = LlamaServer(model, threads=2, ctx_size=512, slots=3, bin_dir=bin_dir, extra_args=["-md", "draft.gguf"])
    try:
        prompts = [[1, 2, 3], [10, 20], [7], [4, 5, 6, 7]]
        answers = server.map(lambda ids: server.completion(ids, n_predict=3, temperature=0.0), prompts)
        assert answers == [("xxx", [2, 3, 4]), ("xx", [11, 21]), ("x", [8]), ("xxx", [5, 6, 7])]
        _, old = server.completion([1, 2], n_predict=2, old_server=True)   # a server that sends only a count
        assert old == [-1, -1]
    finally:
        server.close()
    assert server.proc.poll() is not None                      # stopped
    with open(model + ".argv") as f:
        argv = json.load(f)
    assert argv[argv.index("-np") + 1] == "3" and argv[argv.index("-t") + 1] == "2" and argv[-2:] == ["-md", "draft.gguf"]


def test_no_server_in_the_folder_says_how_to_build(tmp_path):
    with pytest.raises(ValueError, match="build-llamacpp.sh"):
        LlamaServer(os.path.join(tmp_path, "model.gguf"), threads=1, ctx_size=64, bin_dir=str(tmp_path))
