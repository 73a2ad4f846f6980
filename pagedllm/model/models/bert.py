"""Encoder-only models: BERT, RoBERTa and XLM-RoBERTa (their base models for embeddings, their
*ForSequenceClassification variants for classification and cross-encoder scores, their *ForTokenClassification
variants for per-token labels), on the pooling runner only.

Design: every token attends to every token of its own prompt (bidirectional attention), so a prompt's rows
depend on tokens after them and a KV cache of earlier chunks is of no use. The encoder therefore runs each step's
prompts whole, with plain torch attention (SDPA without a causal mask, one sequence at a time; no padding and no
block-diagonal mask of the whole step), and keeps no KV cache: the worker allocates no pool tensors for it, the
block manager only counts blocks for admission. In return the engine must hand it whole prompts: chunked prefill
and prefix caching are off for these models (engine/arg_utils.py), so a prompt longer than max_model_len (the
position table; RoBERTa's less its padding offset) or than max_num_batched_tokens is refused up front, and a chunk
that does not start at position 0 is an error here rather than a silently wrong embedding.

Layers follow transformers' naming (``embeddings.word_embeddings``, ``encoder.layer.N.attention.self.query``…), so
safetensors load as saved, with or without the ``bert.`` / ``roberta.`` prefix (sentence-transformers saves the base
model without it). Token types: a BERT pair's second segment has type 1; a chunk carries where that segment starts
(`SequenceChunk.token_type_start`, from the prompt's ``token_type_ids``), every other token is type 0.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.layers.activation import get_act_fn
from pagedllm.model.layers.embedding import VocabParallelEmbedding
from pagedllm.model.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model.layers.norm import LayerNorm
from pagedllm.model.models.sequence_classification import num_labels_of
from pagedllm.model.models.weights import load_named_weights

_ROBERTA_TYPES = ("roberta", "xlm-roberta")
# Checkpoint tensors no encoder here uses: masked-LM / pre-training heads and saved index buffers.
_UNUSED = ("position_ids", "token_type_ids")
_UNUSED_PREFIXES = ("cls.", "lm_head.")


def position_offset(config: Any) -> int:
    """How far RoBERTa's learned positions are shifted: its first token sits at padding_idx + 1 (BERT: 0)."""
    if getattr(config, "model_type", "") in _ROBERTA_TYPES:
        return int(getattr(config, "pad_token_id", 1) or 0) + 1
    return 0


def max_model_len_of(config: Any) -> int:
    """The longest prompt the position table serves: max_position_embeddings, less RoBERTa's offset."""
    return int(config.max_position_embeddings) - position_offset(config)


class BertEmbeddings(nn.Module):
    """word + position + token type (0 unless told), then LayerNorm."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, hidden, tp, dtype)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(max(int(getattr(config, "type_vocab_size", 1) or 1), 1), hidden,
                                                  dtype=dtype)
        self.LayerNorm = LayerNorm(hidden, float(config.layer_norm_eps), dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    """Fused q/k/v (checkpoint `query`, `key`, `value`) and bidirectional SDPA over each sequence."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        if hidden % heads:
            raise ValueError(f"hidden_size ({hidden}) must be divisible by num_attention_heads ({heads})")
        self.head_dim = hidden // heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, heads, heads, True, tp, dtype)
        self.num_heads = self.qkv_proj.num_heads

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.num_heads * self.head_dim, dim=-1)
        out = []
        start = 0
        for n in seq_lens:
            # [heads, n, head_dim] for one sequence; no mask: every token sees the whole prompt.
            qs, ks, vs = (t[start:start + n].view(n, self.num_heads, self.head_dim).transpose(0, 1) for t in (q, k, v))
            out.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1).reshape(n, -1))
            start += n
        return torch.cat(out) if len(out) > 1 else out[0]


class BertSelfOutput(nn.Module):
    def __init__(self, config: Any, input_shard: tuple[int, int] | None, tp: TensorParallelGroup,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = RowParallelLinear(config.hidden_size, config.hidden_size, True, tp, dtype, input_shard=input_shard)
        self.LayerNorm = LayerNorm(config.hidden_size, float(config.layer_norm_eps), dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        setattr(self, "self", BertSelfAttention(config, tp, dtype))  # transformers' name: `attention.self`
        self.output = BertSelfOutput(config, self.self.qkv_proj.output_features, tp, dtype)

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        return self.output(self.self(x, seq_lens), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, [config.intermediate_size], True, tp, dtype)
        self.act = get_act_fn(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertOutput(nn.Module):
    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = RowParallelLinear(config.intermediate_size, config.hidden_size, True, tp, dtype)
        self.LayerNorm = LayerNorm(config.hidden_size, float(config.layer_norm_eps), dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertLayer(nn.Module):
    """Post-LN: x = LN(x + attn(x)); x = LN(x + mlp(x))."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention = BertAttention(config, tp, dtype)
        self.intermediate = BertIntermediate(config, tp, dtype)
        self.output = BertOutput(config, tp, dtype)

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        x = self.attention(x, seq_lens)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(config, tp, dtype) for _ in range(config.num_hidden_layers)])

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, seq_lens)
        return x


class BertModel(nn.Module):
    """The encoder's final hidden states (the pooling runner pools them: CLS or MEAN). HF-compatible names."""

    supports_token_types = True  # a pair prompt's token_type_ids reach forward() (llm_engine, model_runner)
    # q/k/v checkpoint tensors → (fused parameter, shard id)
    stacked_params = {"query": ("qkv_proj", 0), "key": ("qkv_proj", 1), "value": ("qkv_proj", 2)}
    prefix = "bert."  # the base model's name inside the *ForSequenceClassification checkpoint
    head_names: tuple[str, ...] = ()  # the classifier's tensors, which sit outside the base model
    keeps_pooler = False  # a base model's `pooler.dense` is unused for embeddings (they pool hidden states)

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
            raise ValueError(f"{type(self).__name__} runs as an encoder only; this config sets is_decoder or "
                             f"add_cross_attention, which is not supported.")
        pe_type = getattr(config, "position_embedding_type", "absolute")
        if pe_type not in (None, "absolute"):
            raise ValueError(f"position_embedding_type={pe_type!r} is not supported; allowed: 'absolute'.")
        self.config = config
        self.position_offset = position_offset(config)
        self.embeddings = BertEmbeddings(config, tp, dtype)
        self.encoder = BertEncoder(config, tp, dtype)

    @staticmethod
    def max_model_len(config: Any) -> int:
        """The model's context limit (registry.get_model_max_len)."""
        return max_model_len_of(config)

    def _positions(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """Rows of the position table. RoBERTa numbers each prompt's non-padding tokens from padding_idx + 1 and
        gives padding tokens padding_idx itself (transformers' create_position_ids_from_input_ids)."""
        if not self.position_offset:
            return positions
        pad = self.position_offset - 1
        keep = (input_ids != pad).long()
        counts = torch.cumsum(keep, 0)
        lens = torch.tensor(seq_lens, device=input_ids.device)
        ends = torch.cumsum(lens, 0)
        before = torch.cat([counts.new_zeros(1), counts[ends[:-1] - 1]])  # non-padding tokens of earlier prompts
        return (counts - before.repeat_interleave(lens)) * keep + pad

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any, meta: AttentionMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        seq_lens = list(meta.query_lens_cpu)
        if list(meta.seq_lens_cpu) != seq_lens:
            raise ValueError(f"{type(self).__name__} is an encoder: each prompt must run whole in one step, but this "
                             f"step has prompt chunks that do not start at position 0 (query lengths {seq_lens}, "
                             f"sequence lengths {list(meta.seq_lens_cpu)}).")
        x = self.embeddings(input_ids, self._positions(input_ids, positions, seq_lens), token_type_ids)
        return self.encoder(x, seq_lens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError(f"{type(self).__name__} is an encoder-only model with no LM head: it cannot generate text; "
                         f"serve it with runner='pooling' for embeddings, classification or scores.")

    def _checkpoint_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Checkpoint names → this module tree's: the base-model prefix dropped, unused heads and buffers skipped,
        the classifier's tensors kept as they are."""
        for name, tensor in weights:
            if name.startswith(self.head_names):
                yield name, tensor
                continue
            if name.startswith(self.prefix):
                name = name[len(self.prefix):]
            if name.startswith(_UNUSED_PREFIXES) or name.split(".")[-1] in _UNUSED:
                continue
            if name.startswith("pooler.") and not self.keeps_pooler:
                continue  # a base model's pooler: unused for embeddings (vLLM pools the hidden states)
            name = name.replace(".gamma", ".weight").replace(".beta", ".bias")  # old TF-converted LayerNorms
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_named_weights(self, self._checkpoint_names(weights), self.stacked_params)


class RobertaModel(BertModel):
    """RoBERTa / XLM-RoBERTa: BERT's encoder with positions from padding_idx + 1 and one token type."""

    prefix = "roberta."
    supports_token_types = False  # one token type: pair prompts carry none (their tokenizers give none)


class XLMRobertaModel(RobertaModel):
    pass


class RobertaClassificationHead(nn.Module):
    """transformers' RobertaClassificationHead: dense + tanh + out_proj (applied to the CLS row)."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, dtype=dtype)
        self.out_proj = nn.Linear(config.hidden_size, num_labels_of(config), dtype=dtype)
        self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


class BertPooler(nn.Module):
    """transformers' BertPooler: dense + tanh (applied to the CLS row)."""

    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, dtype=dtype)
        self.dense.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x))


class BertForSequenceClassification(BertModel):
    """BERT cross-encoders / classifiers: pooler (dense + tanh) on the CLS row, then `classifier` (transformers'
    BertForSequenceClassification). `classify` maps rows to label logits; the engine pools CLS, so only the first
    row's result is used."""

    head_names = ("classifier.",)
    keeps_pooler = True

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__(config, tp, dtype)
        self.num_labels = num_labels_of(config)
        self.pooler = BertPooler(config, dtype)
        self.classifier = nn.Linear(config.hidden_size, self.num_labels, dtype=dtype)
        self.classifier.requires_grad_(False)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pooler(hidden))


class RobertaForSequenceClassification(RobertaModel):
    """RoBERTa / XLM-RoBERTa cross-encoders (e.g. bge-reranker): `classifier.dense` + tanh + `classifier.out_proj`
    on the CLS row."""

    head_names = ("classifier.",)

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__(config, tp, dtype)
        self.num_labels = num_labels_of(config)
        self.classifier = RobertaClassificationHead(config, dtype)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(hidden)


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    pass


class _TokenClassifierHead:
    """transformers' *ForTokenClassification head: `classifier` (Linear with bias) on every token's row (no pooler;
    dropout is the identity at inference)."""

    head_names = ("classifier.",)

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__(config, tp, dtype)
        self.num_labels = num_labels_of(config)
        self.classifier = nn.Linear(config.hidden_size, self.num_labels, dtype=dtype)
        self.classifier.requires_grad_(False)

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(hidden)


class BertForTokenClassification(_TokenClassifierHead, BertModel):
    """BERT token classifiers (e.g. NER models)."""


class RobertaForTokenClassification(_TokenClassifierHead, RobertaModel):
    """RoBERTa / XLM-RoBERTa token classifiers."""


class XLMRobertaForTokenClassification(RobertaForTokenClassification):
    pass
