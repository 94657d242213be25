"""EAGLE-3 heads in vLLM's checkpoint format (``model_executor/models/eagle3.py``) on a tiny random
6-layer target: the first draft equals an independent reference of the published architecture
(features from transformers' own hidden states), greedy and seeded outputs equal plain decoding,
and the loader takes vLLM's names and refuses what does not fit."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from specserve import LLM, SamplingParams
from specserve.model_executor.models.eagle3 import is_eagle3_folder

from tiny_models import write_tiny_llama

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FEATURE_LAYERS = [1, 2, 4]
H, INTER, HEADS, KV_HEADS, DRAFT_VOCAB = 64, 128, 4, 2, 4096
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, default_model_tokenizer) -> str:
    return write_tiny_llama(str(tmp_path_factory.mktemp("target6")), seed=3, tokenizer=default_model_tokenizer,
                            embedding_scale=8.0, num_layers=6)


def eagle3_weights(vocab: int, seed: int = 0, prefix: str = "midlayer.") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    hd = H // HEADS
    target_ids = torch.randperm(vocab, generator=g)[:DRAFT_VOCAB].sort().values
    return {
        "fc.weight": rand(H, 3 * H), "norm.weight": 1 + rand(H), "lm_head.weight": rand(DRAFT_VOCAB, H, scale=0.5),
        "d2t": target_ids - torch.arange(DRAFT_VOCAB), "t2d": torch.zeros(vocab, dtype=torch.bool),
        f"{prefix}input_layernorm.weight": 1 + rand(H), f"{prefix}hidden_norm.weight": 1 + rand(H),
        f"{prefix}post_attention_layernorm.weight": 1 + rand(H),
        f"{prefix}self_attn.q_proj.weight": rand(HEADS * hd, 2 * H), f"{prefix}self_attn.k_proj.weight": rand(KV_HEADS * hd, 2 * H),
        f"{prefix}self_attn.v_proj.weight": rand(KV_HEADS * hd, 2 * H), f"{prefix}self_attn.o_proj.weight": rand(H, HEADS * hd),
        f"{prefix}mlp.gate_proj.weight": rand(INTER, H), f"{prefix}mlp.up_proj.weight": rand(INTER, H),
        f"{prefix}mlp.down_proj.weight": rand(H, INTER),
    }


def write_eagle3(folder: str, vocab: int, weights: dict, **config) -> str:
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    hf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
          "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024, "vocab_size": vocab,
          "draft_vocab_size": DRAFT_VOCAB, "eagle_config": {"eagle_aux_hidden_state_layer_ids": FEATURE_LAYERS},
          **config}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf, f)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(folder, "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, default_model_tokenizer) -> str:
    vocab = len(default_model_tokenizer)
    return write_eagle3(str(tmp_path_factory.mktemp("eagle3")), vocab, eagle3_weights(vocab))


@pytest.fixture(scope="module")
def engines(target_dir, head_dir):
    kw = dict(model=target_dir, dtype="float32", max_model_len=256, kv_cache_memory=8 << 20)
    spec = LLM(**kw, speculative_config={"method": "eagle3", "model": head_dir, "num_speculative_tokens": 3})
    return LLM(**kw), spec


def reference_first_draft(target_dir: str, head_dir: str, ids: list[int]) -> int:
    """The head's draft after ``ids`` (prompt + first sampled token), computed from the published
    architecture with transformers' hidden states and plain torch (no specserve code)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    target = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = target(torch.tensor([ids[:-1]]), output_hidden_states=True)
        states = out.hidden_states            # [0]: embeddings; [i]: the input of layer i
        aux = torch.cat([states[i][0] for i in FEATURE_LAYERS], dim=-1)          # [n, 3H]
        w = load_file(os.path.join(head_dir, "model.safetensors"))
        embeds = target.get_input_embeddings()(torch.tensor(ids[1:]))           # tokens x_{t+1}

        def rms(x, weight):
            return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

        h = aux @ w["fc.weight"].T
        x = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"]), rms(h, w["midlayer.hidden_norm.weight"])], -1)
        n, hd = x.shape[0], H // HEADS
        q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(1, n, HEADS, hd).transpose(1, 2)
        k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(1, n, KV_HEADS, hd).transpose(1, 2)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(1, n, KV_HEADS, hd).transpose(1, 2)
        cos, sin = LlamaRotaryEmbedding(config=target.config)(v, torch.arange(n)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
        r = h + attn.transpose(1, 2).reshape(n, H) @ w["midlayer.self_attn.o_proj.weight"].T
        m = rms(r, w["midlayer.post_attention_layernorm.weight"])
        state = r + (F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T) * (m @ w["midlayer.mlp.up_proj.weight"].T)) \
            @ w["midlayer.mlp.down_proj.weight"].T
        logits = rms(state[-1], w["norm.weight"]) @ w["lm_head.weight"].T
        best = int(logits.argmax())
        return best + int(w["d2t"][best])


def test_the_first_draft_is_the_architectures(engines, target_dir, head_dir):
    _, spec = engines
    proposals = []
    proposer = spec.engine.proposer
    original = proposer.propose

    def recording(scheduled):
        proposal = original(scheduled)
        proposals.append([list(t) for t in proposal.token_ids])
        return proposal

    proposer.propose = recording
    try:
        out = spec.generate(PROMPT, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    finally:
        proposer.propose = original
    first = next(p[0] for p in proposals if p and p[0])
    ids = list(out.prompt_token_ids) + [out.outputs[0].token_ids[0]]
    assert first[0] == reference_first_draft(target_dir, head_dir, ids)


def test_greedy_and_seeded_outputs_equal_plain(engines):
    plain, spec = engines
    for params in (SamplingParams(temperature=0, max_tokens=24),
                   SamplingParams(temperature=0.8, seed=5, max_tokens=24)):
        want = plain.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
        got = spec.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want
    assert spec.engine.spec_stats.num_draft_tokens > 0


def test_the_loader_takes_vllms_names_and_refuses_misfits(tmp_path, target_dir, default_model_tokenizer):
    vocab = len(default_model_tokenizer)
    renamed = {("model." + k.replace("midlayer.", "layers.0.")): v for k, v in eagle3_weights(vocab, 1).items()}
    folder = write_eagle3(str(tmp_path / "renamed"), vocab, renamed)
    assert is_eagle3_folder(folder) and not is_eagle3_folder(target_dir)
    llm = LLM(model=target_dir, dtype="float32", max_model_len=128, kv_cache_memory=4 << 20,
              speculative_config={"method": "eagle", "model": folder, "num_speculative_tokens": 2})
    assert llm.engine.runner.model.feature_layers == tuple(FEATURE_LAYERS)
    extra = write_eagle3(str(tmp_path / "extra"), vocab, {**eagle3_weights(vocab), "surprise.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="unexpected weights"):
        LLM(model=target_dir, dtype="float32", max_model_len=128, kv_cache_memory=4 << 20,
            speculative_config={"method": "eagle3", "model": extra})
    wide = write_eagle3(str(tmp_path / "wide"), vocab, eagle3_weights(vocab), target_hidden_size=128)
    with pytest.raises(ValueError, match="trained for another target"):
        LLM(model=target_dir, dtype="float32", max_model_len=128, kv_cache_memory=4 << 20,
            speculative_config={"method": "eagle3", "model": wide})
    with pytest.raises(ValueError, match="needs the EAGLE-3 head's folder"):
        LLM(model=target_dir, speculative_config={"method": "eagle3"})


def test_training_forward_is_the_drafting_forward(target_dir, head_dir):
    """``forward_train`` (what train-draft optimizes) gives the first draft ``forward`` gives."""
    from transformers import AutoModelForCausalLM

    from specserve.model_executor.models.eagle3 import load_eagle3_head

    tok_ids = list(range(300, 320))
    target = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    head = load_eagle3_head(head_dir, torch.float32, 6)
    with torch.no_grad():
        states = target(torch.tensor([tok_ids[:-1]]), output_hidden_states=True).hidden_states
        aux = torch.cat([states[i] for i in FEATURE_LAYERS], dim=-1)              # [1, n, 3H]
        embeds = target.get_input_embeddings()(torch.tensor([tok_ids[1:]]))
        out = head.forward_train(aux, embeds)                                     # [1, n, 2H]
        out2 = head.forward_train_unrolled(aux, embeds)[0]
        best = int((head.logits_input(out[0, -1]) @ head.lm_head.weight.T).argmax())
    assert torch.equal(out, out2)
    assert int(head.draft_vocab[best]) == reference_first_draft(target_dir, head_dir, tok_ids)
