"""Shared fixtures: the real default model (loaded once per session) and drafts
built on its vocabulary (a layer-truncated copy of it, saved as a Hugging Face folder)."""
from __future__ import annotations

import json
import os

# Before torch loads OpenMP (libgomp reads this once): waiting threads sleep instead of
# spinning. On the shared 2-core machines the suite runs on, a spinning OpenMP thread takes
# the core its partner (or another job) needs: we measured the layer tests (fp16_gemm +
# attention) at 42 s with spinning and 2.4 s without when one other process was busy, and
# ~4 s either way on an idle machine. Scheduling only: every result is the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU, Triton's kernels run in its CPU interpreter, which is how the GPU attention
# kernel is tested here (only tests that ask for it, triton_interpreter.use_triton_interpreter,
# send attention there). Set before Triton is first imported (torch does not import it); on a
# CUDA machine Triton compiles as it does for users.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from safetensors.torch import save_file  # noqa: E402

from specserve.config import SpeculativeConfig  # noqa: E402
from specserve.model_executor.loader import load_model  # noqa: E402

from cross_vocab_models import write_mimic_draft  # noqa: E402
from model_cache import share_folder, shared_folder_loads  # noqa: E402
from tiny_models import write_tiny_eagle, write_tiny_llama  # noqa: E402


@pytest.fixture(autouse=True)
def fixed_k_unless_asked(request, monkeypatch):
    """Speculative engines in tests draft a fixed k unless the test sets ``dynamic_k`` itself or
    carries the ``default_dynamic_k`` marker (then the product's default applies: dynamic_k on
    for ngram and suffix). Most tests exercise verification, rollback and the KV cache; on
    random-weight models the default would cut their drafts to nothing and leave them nothing
    to verify, so they would pass without testing what they are about."""
    if request.node.get_closest_marker("default_dynamic_k") is None:
        monkeypatch.setattr(SpeculativeConfig, "DYNAMIC_K_BY_DEFAULT", ())


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's tests with one torch thread (override with SPECSERVE_TEST_THREADS).

    On the shared 2-core machines the suite runs on, two OpenMP threads spin-wait
    on each other whenever one is descheduled: we measured 8 greedy requests x 24
    tokens at 104 s on two threads and 9 s on one. Modules opt in with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("SPECSERVE_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(before)


def write_truncated_draft(folder: str, num_layers: int, dtype=torch.float32) -> str:
    """Save the default model cut to its first ``num_layers`` layers as an HF folder."""
    loaded = load_model(None, dtype)
    keep = {
        name: t.contiguous()
        for name, t in loaded.state_dict.items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    os.makedirs(folder, exist_ok=True)
    save_file(keep, os.path.join(folder, "model.safetensors"))
    config = loaded.config.to_dict()
    config["num_hidden_layers"] = num_layers
    config["architectures"] = ["LlamaForCausalLM"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    loaded.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def truncated_draft_dir(tmp_path_factory) -> str:
    return share_folder(write_truncated_draft(str(tmp_path_factory.mktemp("draft4")), num_layers=4))


@pytest.fixture(scope="session", autouse=True)
def _shared_folder_loads():
    """Folders passed to ``share_folder`` (the session's tiny models, ...) have their tokenizer
    and config read once per session (``model_cache.shared_folder_loads``)."""
    with shared_folder_loads():
        yield


@pytest.fixture(scope="session")
def default_model_tokenizer():
    """The default model's tokenizer (from the converted-GGUF cache), loaded once."""
    return load_model(None, torch.float32, load_weights=False).tokenizer


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_model_tokenizer) -> str:
    folder = str(tmp_path_factory.mktemp("tiny-llama"))
    return share_folder(write_tiny_llama(folder, seed=0, tokenizer=default_model_tokenizer))


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory, default_model_tokenizer) -> str:
    """Another tiny random Llama (seed 1), a draft that often disagrees with ``tiny_llama_dir``."""
    folder = str(tmp_path_factory.mktemp("tiny-draft"))
    return share_folder(write_tiny_llama(folder, seed=1, tokenizer=default_model_tokenizer))


@pytest.fixture(scope="session")
def tiny_fim_dir(tmp_path_factory, default_model_tokenizer) -> str:
    """A tiny random Llama whose tokenizer (the default model's) has Qwen2.5-Coder's
    fill-in-the-middle markers added: the fill-in-the-middle tests' model."""
    import copy

    tok = copy.deepcopy(default_model_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                                                          "<|fim_pad|>", "<|file_sep|>"]})
    return share_folder(write_tiny_llama(str(tmp_path_factory.mktemp("tiny-fim")), seed=1, tokenizer=tok))


@pytest.fixture(scope="session")
def tiny_eagle_dir(tmp_path_factory, tiny_llama_dir) -> str:
    """An EAGLE head made from ``tiny_llama_dir``'s last layer (tiny_models.write_tiny_eagle)."""
    return share_folder(write_tiny_eagle(str(tmp_path_factory.mktemp("tiny-eagle")), tiny_llama_dir))


@pytest.fixture(scope="session")
def peaked_llama_dir(tmp_path_factory, default_model_tokenizer) -> str:
    """The tiny Llama with its logits scaled up (``embedding_scale`` 8): it repeats itself often
    enough for n-gram and suffix lookups to hit, and still samples."""
    folder = str(tmp_path_factory.mktemp("peaked-target"))
    return share_folder(write_tiny_llama(folder, seed=0, tokenizer=default_model_tokenizer, embedding_scale=8.0))


@pytest.fixture(scope="session")
def peaked_eagle_dir(tmp_path_factory, peaked_llama_dir) -> str:
    """An EAGLE head made from ``peaked_llama_dir``'s last layer (tiny_models.write_tiny_eagle)."""
    return share_folder(write_tiny_eagle(str(tmp_path_factory.mktemp("peaked-eagle")), peaked_llama_dir))


@pytest.fixture(scope="session")
def peaked_mimic_dir(tmp_path_factory, peaked_llama_dir) -> str:
    """``peaked_llama_dir`` read through another vocabulary (cross_vocab_models.write_mimic_draft):
    a draft with another tokenizer that agrees with it often."""
    return share_folder(write_mimic_draft(str(tmp_path_factory.mktemp("peaked-mimic")), peaked_llama_dir))


@pytest.fixture(scope="session")
def peaked_draft_dir(tmp_path_factory, default_model_tokenizer) -> str:
    """The same model scaled less (6): a draft that agrees with ``peaked_llama_dir`` often, not always."""
    folder = str(tmp_path_factory.mktemp("peaked-draft"))
    return share_folder(write_tiny_llama(folder, seed=0, tokenizer=default_model_tokenizer, embedding_scale=6.0))
