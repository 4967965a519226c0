"""The decoder, defined once for every family (worker/models/families): its weights,
built from a loader's Hugging Face-named tensors, and its forward over one packed step.
A family's differences are data in its ModelConfig (norm placement, q/k norms, the MLP's
activation, soft-capping, embedding and softmax scales, per-layer windows and rotary
bases), which this recipe and the ops read; no family is named here. A backend
supplies the ops and the KV pool (`DecoderOps`); numpy_decoder_ops.py and
torch_decoder_ops.py in worker/backends are the two implementations.

    x = embedding(tokens) * embed_scale                          # [T, hidden]
    for each layer:
        h, residual = add_rms_norm(x, residual, input_norm)      # residual += x; h = norm(residual)
        qkv = proj(h, qkv)
        qkv = head_norm(qkv, q_norm, k_norm)                     # q/k norm variants only
        q = rope_and_cache(qkv, layer, rope)                     # the layer's rotary table; K, V to the pool
        attn = attention(q, layer, window)                       # [T, heads * head_dim]
        o = proj(attn, o); o = norm(o, attn_out_norm)            # the second: sandwich-norm variants only
        h, residual = add_rms_norm(o, residual, post_norm)
        x = proj(glu(h, gate_up), down)                          # glu = act(gate) * up of proj(h, gate_up)
          or x = moe(h, experts)                                 # MoE layers: routed experts instead
        x = norm(x, mlp_out_norm)                                # sandwich-norm variants only
    where proj(x, w) = lora(linear(x, w), x): each token's LoRA adapter, if any, adds its delta
    h, _ = add_rms_norm(x, residual, final_norm)                # [S, hidden]: what embeddings pool
    logits = soft_cap(lm_head(h))                                # [S, vocab] float32; cap variants only

An MoE layer (ModelConfig.moe_layers) routes each token to its top experts
(moe_routing.py) and sums their SwiGLU outputs by the router's weights; the checkpoint's
expert tensors are read by moe_checkpoint.py and held in whatever form the backend's
`expert_weights` makes (stacked per layer on torch, the layout a fused kernel reads).
Attention sinks (gpt-oss) are one more logit per head in each query's softmax.

RMSNorm weights are stored as offsets from norm_offset in some families (Gemma's
1 + weight); the offset is added once, as the weights are built.
The residual stream is carried apart from each sub-layer's output so that the add and the
next norm are one op (one pass over the activations on CUDA). After the last layer's
attention only the S rows whose logits are wanted go on.

Later work plugs in as op implementations, not as changes to this recipe:
- Quantized linear layers (FP8, INT4 and their scales): `linear_weight` quantizes the
  fused float tensor into its own weight object, and `linear` runs the matching GEMM.
- Tensor parallelism (worker/parallel/sharded_ops.py): `linear_weight` keeps the rank's
  shard, given the projection's role:
  column-parallel for qkv and gate_up (each fused part sharded on its own, which is why
  the parts arrive separately), row-parallel for o and down, whose partial output, with
  the rank's LoRA delta, `lora` all-reduces (it follows every `linear`). The embedding
  and the lm head become vocab-parallel (a masked lookup and an all-reduce; a gather of
  the logits), and the KV pool holds the rank's KV heads.
- Pipeline parallelism (worker/parallel/pipeline.py): a stage's weights hold a run of
  layers (`build_weights(..., layers=)`); the embedding is stage 0's, the final norm and
  lm head the last stage's, and the KV pool holds only the stage's layers (the ops'
  layer index counts from the stage's first). A `StageLink` hands the hidden state
  (x, residual) from one stage's last layer to the next stage's first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

from worker.models.config import CheckpointError, ModelConfig
from worker.models.moe_checkpoint import ExpertTensors, expert_tensors

T = TypeVar("T")  # the backend's tensors: activations, norm and embedding weights
L = TypeVar("L")  # a linear layer's weight, as the backend's `linear_weight` made it
S = TypeVar("S")  # one step's inputs, as the backend prepared them
S_contra = TypeVar("S_contra", contravariant=True)

# Which projection a linear weight is: tensor parallelism splits qkv and gate_up by their
# outputs (column-parallel) and o and down by their inputs (row-parallel, all-reduced).
LinearRole = Literal["qkv", "o", "gate_up", "down"]


class DecoderOps(Protocol[T, L, S_contra]):
    """What a backend supplies to run the decoder. A step (S) carries the token ids,
    positions, KV slots, attention metadata and the rows whose logits are wanted."""

    # -- weights, made once from the loader's float tensors (Hugging Face layout) --------

    def norm_weight(self, tensor: Any) -> T:
        """An RMSNorm weight [hidden] (or [head_dim] for q/k norms), offset already added."""

    def head_weight(self, tensor: Any) -> T:
        """A value per query head [heads] (gpt-oss's attention sinks)."""

    def embedding_weight(self, tensor: Any) -> T:
        """The token embedding [vocab, hidden]."""

    def lm_head_weight(self, tensor: Any) -> T:
        """The output projection [vocab, hidden]. With tied embeddings `tensor` is what
        embedding_weight made, so the largest matrix is held once."""

    def linear_weight(self, parts: Sequence[Any], bias: Sequence[Any] | None, role: LinearRole) -> L:
        """A projection from row blocks [out_i, in], fused along the output in order
        (q, k, v; gate, up), with their biases when the model has them. A single part
        of qkv or gate_up may be the fused tensor itself."""

    # -- one step ----------------------------------------------------------------------

    def embedding(self, table: T, step: S_contra) -> T:
        """The rows [T, hidden] of the step's tokens; prompt-tuning rows take the step's
        given embeddings (ForwardBatch.prompt_rows)."""

    def add_rms_norm(self, x: T, residual: T | None, weight: T, eps: float) -> tuple[T, T]:
        """residual += x (residual := x when None), then RMSNorm of the sum:
        (normalised [N, hidden], the updated residual)."""

    def linear(self, x: T, weight: L) -> T:
        """x [N, in] -> [N, out]."""

    def lora(self, y: T, x: T, layer: int, role: LinearRole, step: S_contra, logits_rows: bool) -> T:
        """y [N, out] = linear(x [N, in]) plus each row's LoRA delta, x @ A.T @ B.T of the
        adapter in the row's slot (ForwardBatch.lora_slots); y as it is when the step runs
        no adapter. `logits_rows`: the N rows are the step's logits rows (past the last
        attention) rather than all its tokens."""

    def head_norm(self, qkv: T, q_weight: T, k_weight: T, eps: float) -> T:
        """RMSNorm of each q head and each k head [head_dim] of the fused qkv [T, ...];
        v as it is. May normalise in place; returns the result."""

    def rope_and_cache(self, qkv: T, layer: int, rope: int, step: S_contra) -> T:
        """Rotary embedding of q and k [T, heads and kv_heads, head_dim] at the step's
        positions, with rotary table `rope` (ModelConfig.layer_rope); writes k and v into
        the layer's KV pool at the step's slots. Returns q [T, heads, head_dim]."""

    def attention(self, q: T, layer: int, window: int | None, step: S_contra, sinks: T | None = None) -> T:
        """Causal attention of each token to its own sequence's cached keys (only the
        last `window` positions when set), with the config's softmax scale and score
        soft-cap: [T, heads * head_dim]. `sinks` [heads]: a logit per head that joins
        the softmax's denominator and weights no value (gpt-oss)."""

    def glu(self, x: T, weight: L, layer: int, step: S_contra, logits_rows: bool) -> T:
        """x [N, hidden] -> act(gate) * up [N, intermediate] (act: config.hidden_act) of
        the gate_up projection with its LoRA delta, lora(linear(x, weight), x, layer,
        "gate_up", ...): one op, so that a backend may fuse the projection with the
        activation."""

    def expert_weights(self, tensors: ExpertTensors) -> Any:
        """One MoE layer's router and experts, in the form `moe` computes with."""

    def moe(self, x: T, experts: Any, layer: int, step: S_contra, logits_rows: bool) -> T:
        """x [N, hidden] -> [N, hidden]: each row's top experts (moe_routing.route over its
        router logits, in float32), their activation (config.expert_act) of gate and up,
        down-projected and summed by the routing weights. Counts the rows each expert
        took (the backend's router statistics). `logits_rows` as for `lora`."""

    def scale(self, x: T, factor: float) -> T:
        """x * factor, with factor rounded to x's dtype first (as transformers does)."""

    def soft_cap(self, logits: T, cap: float) -> T:
        """cap * tanh(logits / cap); may work in place."""

    def logits_rows(self, x: T, step: S_contra) -> T:
        """The rows of x whose logits the step wants, in order."""

    def lm_head(self, x: T, weight: T) -> T:
        """x [S, hidden] -> float32 logits [S, vocab]."""


class StageLink(Protocol[T, S_contra]):
    """A pipeline stage's ends: the hidden state between two stages' layers."""

    def receive(self, step: S_contra) -> tuple[T, T]:
        """(x, residual) [T, hidden] as the previous stage's last layer left them."""

    def send(self, x: T, residual: T, step: S_contra) -> T:
        """Hand (x, residual) to the next stage; returns what was sent."""


@dataclass(frozen=True, slots=True)
class LayerWeights(Generic[T, L]):
    input_norm: T  # [hidden]
    qkv: L  # hidden -> (heads + 2 * kv_heads) * head_dim: q, k, v fused (+ biases, Qwen2)
    o: L  # heads * head_dim -> hidden
    post_norm: T  # [hidden], before the MLP
    gate_up: L | None  # hidden -> 2 * intermediate: gate, then up (None in MoE layers)
    down: L | None  # intermediate -> hidden
    window: int | None  # sliding window (Mistral), None for full attention
    rope: int = 0  # the rotary table (ModelConfig.layer_rope)
    q_norm: T | None = None  # [head_dim], with k_norm: per-head norms before the rotary embedding
    k_norm: T | None = None
    attn_out_norm: T | None = None  # [hidden], sandwich norms: on the attention's output
    mlp_out_norm: T | None = None  # [hidden], and on the MLP's
    experts: Any = None  # MoE layers: the router and experts as `expert_weights` made them
    sinks: T | None = None  # [heads], attention sinks (gpt-oss)


@dataclass(frozen=True, slots=True)
class DecoderWeights(Generic[T, L]):
    """The whole model's weights, or a pipeline stage's: then the embedding only on the
    first stage, the final norm and lm head only on the last (None elsewhere)."""

    config: ModelConfig
    embed: T | None  # [vocab, hidden]
    layers: list[LayerWeights[T, L]]
    final_norm: T | None  # [hidden]
    lm_head: T | None  # [vocab, hidden] as the ops hold it; made from `embed` when tied


def build_weights(
    config: ModelConfig, tensors: Mapping[str, Any], ops: DecoderOps[T, L, Any], layers: range | None = None
) -> DecoderWeights[T, L]:
    """The decoder's weights in the form `ops` computes with, from Hugging Face-named float
    tensors. A fused `...qkv_proj.*` or `...gate_up_proj.weight` is taken as is (so a caller
    can hand over memory it already holds fused). `layers`: a pipeline stage's (default
    all); only their tensors, and the embedding or the head where the stage has them, are read."""

    def need(name: str) -> Any:
        if name not in tensors:
            raise CheckpointError(f"tensor {name!r} is missing")
        return tensors[name]

    def parts(fused: str, names: list[str]) -> list[Any]:
        return [tensors[fused]] if fused in tensors else [need(name) for name in names]

    def norm(name: str) -> T:
        tensor = need(name)
        return ops.norm_weight(tensor + config.norm_offset if config.norm_offset else tensor)

    # Sandwich-norm checkpoints name the norm after attention post_attention_layernorm
    # and the one before the MLP pre_feedforward_layernorm.
    mlp_norm = "pre_feedforward_layernorm" if config.sandwich_norms else "post_attention_layernorm"

    layers = range(config.num_layers) if layers is None else layers
    first, last = layers.start == 0, layers.stop == config.num_layers
    built = []
    for i in layers:
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = parts(attn + "qkv_proj.weight", [attn + f"{n}_proj.weight" for n in "qkv"])
        bias = None
        if config.attention_bias:
            bias = parts(attn + "qkv_proj.bias", [attn + f"{n}_proj.bias" for n in "qkv"])
        o_bias = [need(attn + "o_proj.bias")] if config.o_bias else None
        layer = f"model.layers.{i}."
        experts, gate_up, down = None, None, None
        if i in config.moe_layers:
            experts = ops.expert_weights(expert_tensors(config, need, i))
        else:
            dense = parts(mlp + "gate_up_proj.weight", [mlp + "gate_proj.weight", mlp + "up_proj.weight"])
            gate_up = ops.linear_weight(dense, None, "gate_up")
            down = ops.linear_weight([need(mlp + "down_proj.weight")], None, "down")
        built.append(
            LayerWeights(
                input_norm=norm(layer + "input_layernorm.weight"),
                qkv=ops.linear_weight(qkv, bias, "qkv"),
                o=ops.linear_weight([need(attn + "o_proj.weight")], o_bias, "o"),
                post_norm=norm(layer + mlp_norm + ".weight"),
                gate_up=gate_up,
                down=down,
                window=config.sliding_window if i in config.sliding_layers else None,
                rope=config.layer_rope(i),
                q_norm=norm(attn + "q_norm.weight") if config.qk_norm else None,
                k_norm=norm(attn + "k_norm.weight") if config.qk_norm else None,
                attn_out_norm=norm(layer + "post_attention_layernorm.weight") if config.sandwich_norms else None,
                mlp_out_norm=norm(layer + "post_feedforward_layernorm.weight") if config.sandwich_norms else None,
                experts=experts,
                sinks=ops.head_weight(need(attn + "sinks")) if config.attention_sinks else None,
            )
        )
    embed = None
    if first or (last and config.tie_word_embeddings):  # a tied head is made from the embedding
        embed = ops.embedding_weight(need("model.embed_tokens.weight"))
    head = None
    if last:
        head = ops.lm_head_weight(embed if config.tie_word_embeddings else need("lm_head.weight"))
    return DecoderWeights(
        config=config,
        embed=embed if first else None,
        layers=built,
        final_norm=norm("model.norm.weight") if last else None,
        lm_head=head,
    )


def forward(model: DecoderWeights[T, L], ops: DecoderOps[T, L, S], step: S, link: StageLink[T, S] | None = None,
            *, hidden: bool = False) -> T:
    """Float32 logits [S, vocab] of the step's wanted rows; writes its K and V to the pool.
    With `hidden`, the wanted rows' final hidden state [S, hidden] instead (after the
    final norm, in the ops' dtype): what embeddings pool. A pipeline stage's weights
    run with its `link`: a stage after the first takes its input from the previous one,
    a stage before the last returns what it sent on."""
    cfg = model.config
    eps = cfg.rms_norm_eps
    residual: T | None = None
    if model.embed is not None:
        x = ops.embedding(model.embed, step)
        if cfg.embed_scale != 1.0:
            x = ops.scale(x, cfg.embed_scale)
    else:
        assert link is not None
        x, residual = link.receive(step)
    # Past the last attention of the last stage, only the rows whose logits are wanted matter.
    last = len(model.layers) - 1 if model.lm_head is not None else -1
    rows = False  # whether the activations are down to the logits rows
    for i, layer in enumerate(model.layers):
        h, residual = ops.add_rms_norm(x, residual, layer.input_norm, eps)
        qkv = ops.lora(ops.linear(h, layer.qkv), h, i, "qkv", step, rows)
        if layer.q_norm is not None and layer.k_norm is not None:
            qkv = ops.head_norm(qkv, layer.q_norm, layer.k_norm, eps)
        q = ops.rope_and_cache(qkv, i, layer.rope, step)
        attn = ops.attention(q, i, layer.window, step, layer.sinks)
        if i == last:
            attn, residual = ops.logits_rows(attn, step), ops.logits_rows(residual, step)
            rows = True
        o = ops.lora(ops.linear(attn, layer.o), attn, i, "o", step, rows)
        if layer.attn_out_norm is not None:
            o, _ = ops.add_rms_norm(o, None, layer.attn_out_norm, eps)
        h, residual = ops.add_rms_norm(o, residual, layer.post_norm, eps)
        if layer.experts is not None:
            x = ops.moe(h, layer.experts, i, step, rows)
        else:
            assert layer.gate_up is not None and layer.down is not None
            act = ops.glu(h, layer.gate_up, i, step, rows)
            x = ops.lora(ops.linear(act, layer.down), act, i, "down", step, rows)
        if layer.mlp_out_norm is not None:
            x, _ = ops.add_rms_norm(x, None, layer.mlp_out_norm, eps)
    if model.lm_head is None:
        assert link is not None and residual is not None
        return link.send(x, residual, step)
    assert model.final_norm is not None
    h, _ = ops.add_rms_norm(x, residual, model.final_norm, eps)
    if hidden:
        return h
    logits = ops.lm_head(h, model.lm_head)
    return logits if cfg.final_logit_softcap is None else ops.soft_cap(logits, cfg.final_logit_softcap)
