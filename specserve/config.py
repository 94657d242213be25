"""Engine and speculative-decoding configuration, validated when built.

Every config is a dataclass that checks itself in ``__post_init__`` and rejects
unknown keys when built from a dict, so a typo is an error, not a silent default.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

# k + 1 new tokens of a request fit the CPU attention kernel's 32-bit tree masks (a node sees its
# ancestors: cpu_kernels/paged_attention.c). Suffix decoding's trees on repeated tasks accept
# drafts that deep (docs/benchmarks.md, "Suffix decoding"); a model's drafts rarely pay past 8.
MAX_SPECULATIVE_TOKENS = 31
DEFAULT_SPECULATIVE_TOKENS = 4  # k when neither the user nor the draft says otherwise
# A draft model's or EAGLE head's tree holds at most this many drafts (the attention masks have
# no width limit; this bounds the lookahead slots a request reserves).
MAX_TREE_NODES = 256


def _from_dict(cls, values: dict, what: str):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {what} keys {unknown}; known keys: {sorted(known)}")
    return cls(**values)


@dataclass
class SpeculativeConfig:
    """How tokens are proposed for verification.

    method: "draft_model" (a smaller model with the target's vocabulary),
    "ngram" (prompt lookup: no model), "suffix" (suffix decoding: counted
    continuations of the request's own tokens and of recent requests', no model)
    or "eagle" (a head over the target's hidden states: specserve's EAGLE-1 heads, and vLLM's
    EAGLE-3 checkpoints, told apart by their folder; "eagle3" is the same), or "grammar" (no proposer:
    only the forced tokens of constrained requests' grammars, below). ``model`` is
    anything the loader accepts.
    """

    method: str | None = None
    model: str | None = None
    # None: the draft's own recommendation (an EAGLE head's eagle_config.json may
    # carry the k it was measured best at), suffix_max_depth for suffix decoding, else
    # DEFAULT_SPECULATIVE_TOKENS.
    num_speculative_tokens: int | None = None
    draft_tensor_parallel_size: int | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # ngram: propose min(k, matched suffix length) tokens instead of always k. A
    # one-token match is a weak hint and a long one a strong one; on CPUs each
    # extra verified position costs ~5% of a step (docs/speculative_decoding.md).
    prompt_lookup_adaptive: bool = True
    # ngram: propose the continuations of several earlier occurrences as a tree of at
    # most k tokens (always adaptive), verified in one pass (docs/speculative_decoding.md).
    prompt_lookup_tree: bool = False
    # suffix: the draft tree's depth at most, the smallest probability (count-based, the
    # product along its path) a draft token may have, and how many recent requests the
    # global suffix trie keeps (0: none, only each request's own tokens). A tree holds at most
    # min(k, suffix_max_spec_factor x the matched suffix's length) tokens. Without a k, suffix
    # decoding's k is suffix_max_depth (as in vLLM); depth 16 measured 1.07x depth 8 on a repeated
    # JSON task and the same on short code edits (docs/benchmarks.md, "Suffix decoding").
    suffix_max_depth: int = 16
    suffix_min_token_prob: float = 0.1
    suffix_max_cached_requests: int = 256
    suffix_max_spec_factor: float = 1.0
    draft_dtype: str | None = None   # defaults to the target's dtype
    # draft_model: the draft's GGUF blocks multiply with int8 activations (EngineConfig.int8_activations).
    # None (default): whatever the target does, on (VNNI, AVX2 or AMX int8 tiles), except on an AMX
    # CPU whose build lacks int8 tiles, where float32 activations on bfloat16 tiles are faster at
    # several rows: the draft's numbers only change its guesses, never the output, and its forward is
    # the cost speculation must win back (factory.draft_uses_int8_activations; docs/real_models.md).
    draft_int8_activations: bool | None = None
    # draft_model: the draft's LM head keeps only the first N token ids (byte-pair vocabularies
    # number tokens roughly by merge order, so these are the common ones); the draft then never
    # proposes the others. Its cost drops by the rest of the head; output stays the target's
    # (docs/real_models.md). None: the whole vocabulary.
    draft_vocab_size: int | None = None
    # draft_model: the draft's GGUF blocks requantized at load to this format ("q4_0", "q4_1",
    # "q5_0", "q5_1", "q8_0"), fewer bytes streamed per draft step; its guesses change a little,
    # the output never (docs/real_models.md). None: the file's formats.
    draft_quantization: str | None = None
    # Skip drafting in steps with at least this many decoding requests: a large
    # batch already uses the hardware well, and verifying k+1 positions per
    # request then costs more than it saves (vLLM's disable_by_batch_size).
    disable_by_batch_size: int | None = None
    # Choose each request's draft length every step from measured costs and acceptance
    # (spec_decode/k_policy.py); num_speculative_tokens is then the maximum. Requests with
    # a seed keep the fixed k so their samples stay reproducible (timings vary run to run).
    # None (default): on for ngram and suffix, whose drafts cost only a lookup: n-gram was measured
    # as fast as the best fixed k at batch 1 and as plain decoding at batch 8 to 64, where every
    # fixed draft row costs about a request's own row; suffix 1.12x its fixed k on a repeated
    # task. Off for draft_model and eagle (docs/speculative_decoding.md says why).
    dynamic_k: bool | None = None
    # Structured output: where a request's grammar allows only one continuation (a schema's keys,
    # quotes, braces, commas), its tokens are added to the proposer's drafts, up to k in all
    # (engine/constraints.py). Verification keeps them exact like any draft; they are nearly
    # always accepted. With method "grammar" they are the only drafts.
    grammar_drafts: bool = True
    # draft_model: a draft whose tokenizer differs from the target's drafts across vocabularies
    # (spec_decode/cross_vocab.py): "slem" (its text tokenized again for the target, one-hot
    # drafts) or "tli" (its distribution kept on the tokens both vocabularies spell alike, moved to
    # target ids). Both are lossless at every temperature. None: "tli" when the vocabularies
    # differ (docs/speculative_decoding.md, "Drafts with another tokenizer", says why), the plain
    # draft model when they are the same; naming a method forces that path on any draft.
    cross_vocab: str | None = None
    # draft_model / eagle: propose a tree of drafts instead of a chain (spec_decode/draft_tree.py),
    # e.g. {"top_k": 4, "max_nodes": 16}; a dict of TreeConfig's fields, a TreeConfig, or the text
    # "TOP_K/MAX_NODES[/MAX_DEPTH][/sampled][/dynamic]" (command lines: TreeConfig.parse). The tree
    # is num_speculative_tokens deep at most unless max_depth says otherwise. None: a chain.
    tree: "TreeConfig | dict | None" = None

    METHODS = ("draft_model", "ngram", "eagle", "eagle3", "suffix", "grammar")
    CROSS_VOCAB_METHODS = ("slem", "tli")           # spec_decode/cross_vocab.py's METHODS (config sits below it)
    DYNAMIC_K_BY_DEFAULT = ("ngram", "suffix")   # the methods whose dynamic_k default (None) means on
    # the names of quantized.REQUANTIZE_FORMATS (config sits below model_executor)
    DRAFT_QUANTIZATIONS = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "draft_model" if self.model is not None else None
        if self.method not in self.METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; choose one of {list(self.METHODS)}")
        if self.method == "eagle3":       # vLLM's name: the eagle proposer reads either kind of head
            if self.model is None:
                raise ValueError("method 'eagle3' needs the EAGLE-3 head's folder as its model")
            self.method = "eagle"
        k = self.num_speculative_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not (1 <= k <= MAX_SPECULATIVE_TOKENS)):
            raise ValueError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"disable_by_batch_size must be a positive integer, got {b!r}")
        if not isinstance(self.grammar_drafts, bool):
            raise ValueError(f"grammar_drafts must be True or False, got {self.grammar_drafts!r}")
        if self.method == "grammar" and self.model is not None:
            raise ValueError("the grammar method takes no speculative model")
        if self.dynamic_k is None:
            self.dynamic_k = self.method in self.DYNAMIC_K_BY_DEFAULT
        if not isinstance(self.dynamic_k, bool):
            raise ValueError(f"dynamic_k must be True, False or None, got {self.dynamic_k!r}")
        if self.draft_int8_activations is not None and not isinstance(self.draft_int8_activations, bool):
            raise ValueError(f"draft_int8_activations must be True, False or None, got {self.draft_int8_activations!r}")
        v = self.draft_vocab_size
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"draft_vocab_size must be a positive integer, got {v!r}")
        if v is not None and self.method != "draft_model":
            raise ValueError(f"draft_vocab_size is a draft_model option, not for method {self.method!r}")
        if self.cross_vocab is not None:
            if self.cross_vocab not in self.CROSS_VOCAB_METHODS:
                raise ValueError(f"cross_vocab must be one of {list(self.CROSS_VOCAB_METHODS)} or None, "
                                 f"got {self.cross_vocab!r}")
            if self.method != "draft_model":
                raise ValueError(f"cross_vocab is a draft_model option, not for method {self.method!r}")
        q = self.draft_quantization
        if q is not None:
            if q not in self.DRAFT_QUANTIZATIONS:
                raise ValueError(f"draft_quantization must be one of {list(self.DRAFT_QUANTIZATIONS)}, got {q!r}")
            if self.method != "draft_model":
                raise ValueError(f"draft_quantization is a draft_model option, not for method {self.method!r}")
        d = self.draft_tensor_parallel_size
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"draft_tensor_parallel_size must be a positive integer, got {d!r}")
        if self.tree is not None:
            if self.method not in ("draft_model", "eagle"):
                raise ValueError(f"tree is a draft_model / eagle option (ngram: prompt_lookup_tree), "
                                 f"not for method {self.method!r}")
            if isinstance(self.tree, str):
                self.tree = TreeConfig.parse(self.tree)
            if isinstance(self.tree, dict):
                self.tree = _from_dict(TreeConfig, dict(self.tree), "speculative_config tree")
            if not isinstance(self.tree, TreeConfig):
                raise ValueError(f"tree must be a dict of {[f.name for f in fields(TreeConfig)]} or None, "
                                 f"got {self.tree!r}")
            if self.cross_vocab is not None:
                raise ValueError("a tree of drafts needs a draft with the target's vocabulary (no cross_vocab)")
            if self.dynamic_k:
                raise ValueError("dynamic_k sizes chains; a draft tree picks its shape with tree dynamic=True")
        if self.prompt_lookup_tree and self.method != "ngram":
            raise ValueError(f"prompt_lookup_tree is an ngram option (trees of drafts are verified for "
                             f"proposers without probabilities), not for method {self.method!r}")
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("the ngram method takes no speculative model")
            if not (1 <= self.prompt_lookup_min <= self.prompt_lookup_max):
                raise ValueError(
                    "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                    f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
                )

        suffix_defaults = {f.name: f.default for f in fields(self) if f.name.startswith("suffix_")}
        if self.method != "suffix":
            changed = sorted(n for n, d in suffix_defaults.items() if getattr(self, n) != d)
            if changed:
                raise ValueError(f"{', '.join(changed)}: suffix options, not for method {self.method!r}")
        else:
            if self.model is not None:
                raise ValueError("the suffix method takes no speculative model")
            depth = self.suffix_max_depth
            if not _is_int(depth) or not (1 <= depth <= MAX_SPECULATIVE_TOKENS):
                raise ValueError(f"suffix_max_depth must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {depth!r}")
            prob = self.suffix_min_token_prob
            if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not (0.0 <= prob <= 1.0):
                raise ValueError(f"suffix_min_token_prob must be a number in [0, 1], got {prob!r}")
            factor = self.suffix_max_spec_factor
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
                raise ValueError(f"suffix_max_spec_factor must be a positive number, got {factor!r}")
            cached = self.suffix_max_cached_requests
            if not _is_int(cached) or cached < 0:
                raise ValueError(f"suffix_max_cached_requests must be a non-negative integer, got {cached!r}")

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots a decoding request reserves for drafts: k for a chain; for a tree, its nodes
        or the nodes the draft expands to reach the tree's depth (``top_k`` at each depth but the
        last, each computed in the draft's cache at a slot of its own), whichever is more."""
        if self.tree is not None:
            return max(self.tree.max_nodes, self.tree.top_k * (self.tree.depth(self.num_speculative_tokens) - 1))
        return self.num_speculative_tokens or 0

    @classmethod
    def from_dict(cls, values: dict) -> "SpeculativeConfig":
        return _from_dict(cls, dict(values), "speculative_config")


@dataclass
class TreeConfig:
    """A draft model's or EAGLE head's tree of drafts (spec_decode/draft_tree.py).

    Grown best first by EAGLE-2's rule: every expanded node's ``top_k`` likeliest children are
    candidates, each depth expands the ``top_k`` candidates of highest cumulative draft
    probability in one batched draft forward, and the ``max_nodes`` best candidates form the
    tree, ``max_depth`` deep at most (None: num_speculative_tokens). ``children``: "topk" (a
    node's children are the draft's top_k tokens, verified by the target's choice at every node)
    or "sampled" (drawn from the draft without replacement, verified by recursive rejection
    sampling; seeded requests by the target's choices). ``dynamic``: pick each step's tree size
    (or a chain) from measured costs and acceptance (spec_decode/tree_policy.py). "sampled" is
    the default: at temperature 0.7 on the Qwen pair its trees accepted more (tau 4.13 against
    3.79, docs/speculative_decoding.md); greedy requests get the top-k children either way.
    """

    top_k: int = 4
    max_nodes: int = 16
    max_depth: int | None = None
    children: str = "sampled"
    dynamic: bool = False

    CHILDREN = ("topk", "sampled")

    def depth(self, num_speculative_tokens: int | None) -> int:
        """How deep the tree grows: ``max_depth``, else k (else the default k)."""
        return self.max_depth or num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS

    @classmethod
    def parse(cls, text: str) -> "TreeConfig":
        """"TOP_K/MAX_NODES[/MAX_DEPTH][/sampled|topk][/dynamic]", e.g. "4/16", "4/24/6/sampled"."""
        parts = [p.strip() for p in text.split("/")]
        values: dict = {}
        try:
            numbers = [int(p) for p in parts if p.isdigit()]
        except ValueError:
            numbers = []
        words = [p for p in parts if not p.isdigit()]
        if not 2 <= len(numbers) <= 3 or any(w not in (*cls.CHILDREN, "dynamic") for w in words):
            raise ValueError(f"tree {text!r}: expected TOP_K/MAX_NODES[/MAX_DEPTH][/sampled|topk][/dynamic]")
        values.update(zip(("top_k", "max_nodes", "max_depth"), numbers))
        for w in words:
            values.update({"dynamic": True} if w == "dynamic" else {"children": w})
        return cls(**values)

    def __post_init__(self) -> None:
        if not _is_int(self.top_k) or not 1 <= self.top_k <= 64:
            raise ValueError(f"tree top_k must be an integer in [1, 64], got {self.top_k!r}")
        if not _is_int(self.max_nodes) or not 1 <= self.max_nodes <= MAX_TREE_NODES:
            raise ValueError(f"tree max_nodes must be an integer in [1, {MAX_TREE_NODES}], got {self.max_nodes!r}")
        if self.max_depth is not None and (not _is_int(self.max_depth) or not 1 <= self.max_depth <= MAX_TREE_NODES):
            raise ValueError(f"tree max_depth must be an integer in [1, {MAX_TREE_NODES}] or None, "
                             f"got {self.max_depth!r}")
        if self.children not in self.CHILDREN:
            raise ValueError(f"tree children must be one of {list(self.CHILDREN)}, got {self.children!r}")
        if not isinstance(self.dynamic, bool):
            raise ValueError(f"tree dynamic must be True or False, got {self.dynamic!r}")


@dataclass
class EngineConfig:
    """Everything the engine needs besides the model weights.

    kv_cache_memory: bytes of KV cache for the target (the draft's cache is
    sized to the same number of blocks). max_num_batched_tokens is the per-step
    token budget shared by prefill chunks and decode/verification tokens.
    enable_prefix_caching: reuse the KV blocks of earlier requests' identical
    prefixes (``core.kv_cache_manager``); the blocks carry a draft model's or
    EAGLE head's K/V too.
    int8_activations: with a GGUF model's blocks kept on a CPU (dtype "auto"),
    multiply them with activations rounded to 8 bits per 256 values (byte
    products, as llama.cpp computes, on AVX-512 VNNI or AVX2; faster, not the
    float32-activation numbers). Speculation stays lossless against plain decoding with the same
    setting. Ignored where the CPU or a format has no such kernel. An integer
    2-4 instead of True multiplies each activation row as that many int8
    pieces summed: 3 pieces carry float32's precision (2^-24 of each 256-value
    group's largest value) and decode one row about twice as fast as the
    float32 kernels, but cost about 3x per extra row (verification, prefill).
    On CPUs with AMX every setting runs on int8 tiles (rounded per 32-value
    sub-block; Q6_K with True or 2 keeps the VNNI kernel), where a pass of the
    tiles takes 16 / N rows: with True a matrix multiplies one row at the VNNI
    kernel's speed (a whole 1.5B decode step about 6% slower) and 5-16 rows
    1.8x-3.8x faster; 3 pieces decode one row in 0.77x-0.98x
    the float32 tiles' time, up to 5 rows 0.97x-1.45x, more rows 1.2x-1.9x
    (docs/architecture.md, "Numerics").
    enforce_eager: run every step op by op. Otherwise, on a GPU, decode and verification steps
    (of the target and of a draft model) are captured as CUDA graphs per batch and query
    bucket and replayed (``worker/cuda_graphs.py``), as vLLM does; a CPU has no graphs.
    scheduling_policy: "fcfs" (first come, first served) or "priority" (vLLM's): requests carry a
    priority (lower first; ``LLM.generate(..., priority=[...])``, the API's ``priority`` field),
    which orders the queue and chooses whom a full KV cache preempts (``core.scheduler``).
    generation_config: where requests' sampling defaults come from (vLLM's): "auto" (the
    model's generation_config.json, or a GGUF file's general.sampling.* metadata), "vllm"
    (none: SamplingParams' own) or a folder holding a generation_config.json (or the file);
    override_generation_config sets fields on top ({"temperature": 0.5}).
    (``model_executor/generation_config.py`` has which fields and how they are read.)
    pooling: how ``LLM.embed`` and /v1/embeddings pool a prompt's final hidden states: "last",
    "mean" or "cls" (``engine/embedding.py``).
    enable_lora: let requests run with PEFT LoRA adapters (vLLM's; ``LoRARequest``,
    ``engine/lora_adapters.py``): at most ``max_loras`` adapters in one step (requests of another
    wait), each of rank at most ``max_lora_rank``, and up to ``max_cpu_loras`` (None: max_loras)
    kept loaded while no request uses them.
    overlap_grammar_masks: compute a step's structured-output masks in a background thread
    while the target's forward runs (``structured_output.step_masks``); None: on where the
    forward runs on a GPU (the host is idle then), off on a CPU, where the forward's threads
    already use every core (docs/serving.md has the measurement).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str | None = None            # None: cuda if available, else cpu
    max_model_len: int | None = None     # None: the model's own limit, capped at 8192
    kv_cache_memory: int = 1 << 30       # bytes
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    seed: int = 0
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True
    int8_activations: bool | int = False
    overlap_grammar_masks: bool | None = None
    enforce_eager: bool = False
    scheduling_policy: str = "fcfs"
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    pooling: str = "last"
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    SCHEDULING_POLICIES = ("fcfs", "priority")

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a path, a .gguf file or a cached hub id (a string), "
                            f"got {type(self.model).__name__} {self.model!r}")
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if not isinstance(self.dtype, str) and not _is_torch_dtype(self.dtype):
            raise TypeError(f"dtype must be a string such as 'auto' or 'float32', got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size", "kv_cache_memory",
                     "max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 1):
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.max_cpu_loras is not None and (not _is_int(self.max_cpu_loras) or self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer at least max_loras ({self.max_loras}), "
                             f"got {self.max_cpu_loras!r}")
        if self.pooling not in ("last", "mean", "cls"):
            raise ValueError(f"pooling must be 'last', 'mean' or 'cls', got {self.pooling!r}")
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be True or False, got {self.enable_lora!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if not (isinstance(self.int8_activations, bool) or (_is_int(self.int8_activations)
                                                            and 0 <= self.int8_activations <= 4)):
            raise ValueError(f"int8_activations must be True, False or a number of pieces 1-4, "
                             f"got {self.int8_activations!r}")
        if self.overlap_grammar_masks is not None and not isinstance(self.overlap_grammar_masks, bool):
            raise ValueError(f"overlap_grammar_masks must be True, False or None, got {self.overlap_grammar_masks!r}")
        if self.scheduling_policy not in self.SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {self.SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if not isinstance(self.generation_config, (str, os.PathLike)) or not os.fspath(self.generation_config):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}")
        self.generation_config = os.fspath(self.generation_config)
        if self.override_generation_config is not None and not isinstance(self.override_generation_config, dict):
            raise ValueError(f"override_generation_config must be a dict such as {{'temperature': 0.5}}, "
                             f"got {self.override_generation_config!r}")
        _check_device(self.device)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_torch_dtype(x) -> bool:
    import torch

    return isinstance(x, torch.dtype)


def _check_device(device) -> None:
    """A device string torch understands and this machine has (no AssertionError from deep in torch)."""
    if device is None:
        return
    import torch

    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a string such as 'cpu' or 'cuda', got {device!r}")
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"unknown device {device!r}: {e}") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this PyTorch build has no CUDA support" if torch.version.cuda is None
                   else "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES)")
            raise ValueError(f"device={device!r} was asked for, but CUDA is not available: {why}; "
                             "use device='cpu' or leave device unset")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif parsed.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: specserve runs on 'cpu' or 'cuda'")
