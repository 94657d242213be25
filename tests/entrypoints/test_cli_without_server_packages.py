"""The command line and the engine need none of the server's packages (fastapi, starlette,
uvicorn, pydantic, the OpenAI client) nor GGUF or structured output's: GPU machines that lack
them still run `specserve bench` and the engine (benchmarks/gpu_check.sh) on Hugging Face folders."""
from __future__ import annotations

import os
import subprocess
import sys

BLOCKER = """
import importlib.abc, sys
BLOCKED = {"gguf", "llguidance", "fastapi", "uvicorn", "pydantic", "jsonschema", "openai", "starlette"}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError("not installed here: " + name)
sys.meta_path.insert(0, Blocker())
"""


def test_the_command_line_and_an_engine_run_without_the_server_packages(tiny_llama_dir):
    code = BLOCKER + f"""
from specserve.entrypoints.cli import build_parser
build_parser().parse_args(["bench", "forward-rows", "--models", "shape:tiny"])
from specserve import LLM, SamplingParams
out = LLM(model={tiny_llama_dir!r}, max_model_len=128, kv_cache_memory=1 << 22,
          speculative_config={{"method": "ngram", "num_speculative_tokens": 2}}).generate(
    "Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print(len(out[0].outputs[0].token_ids))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "4"
