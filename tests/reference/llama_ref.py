#!/usr/bin/python3
"""Independent float64 PyTorch reference for a Hugging Face Llama-family decoder.

Reads a Hugging Face model directory (config.json + model.safetensors, or
sharded model-0000X-of-0000N.safetensors + model.safetensors.index.json),
runs a full causal forward pass over the given token ids at positions 0..T-1
and prints the logits as JSON, in the same shape as `pdserve model logits`:

    /usr/bin/python3 tests/reference/llama_ref.py --model DIR --tokens 1,2,3
        -> {"logits": [v0, v1, ..., v_{vocab-1}]}          (last position)
    /usr/bin/python3 tests/reference/llama_ref.py --model DIR --tokens 1,2,3 --all-positions
        -> {"logits": [[...], [...], [...]]}               (one list per position)

Covered: Llama / Llama-3.x (incl. "llama3" rope_scaling), Mistral-style GQA,
Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm before RoPE), tied
embeddings, explicit head_dim, and the Mixture-of-Experts Mixtral (softmax
top-k renormalised) and Qwen3-MoE (norm_topk_prob, decoder_sparse_step,
mlp_only_layers), and DeepSeek-V2/V3 (MLA attention with or without q LoRA,
decoupled interleaved RoPE with YaRN and its mscale, DeepSeek MoE routing with
shared experts and dense first layers); weights stored as
F32 / F16 / BF16 (F64 also accepted). All arithmetic is done in float64.
No dependency on `safetensors` or `transformers`: the file format is parsed here.

The module is importable: load_config(), Checkpoint, forward(), reference_logits().
Errors are reported on stderr with exit status 1.
"""

import argparse
import json
import math
import os
import struct
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch


class RefError(Exception):
    """A user-facing error (bad model directory, missing tensor, wrong shape...)."""


# --------------------------------------------------------------------------
# safetensors reader
# --------------------------------------------------------------------------

# dtype tag -> (numpy dtype of the raw little-endian storage, bytes per element)
_ST_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # raw bits; widened to float32 below
}


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """BF16 -> float32: put the 16 bits into the high half of a uint32."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


class SafetensorsFile:
    """Lazy reader for one .safetensors file (memory-mapped)."""

    def __init__(self, path: str):
        self.path = path
        try:
            file_size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) != 8:
                    raise RefError(f"{path}: file too short for a safetensors header")
                (header_len,) = struct.unpack("<Q", head)
                if header_len > file_size - 8:
                    raise RefError(f"{path}: header length {header_len} exceeds file size {file_size}")
                header_bytes = f.read(header_len)
        except OSError as e:
            raise RefError(f"cannot read safetensors file {path}: {e.strerror}") from None
        try:
            header = json.loads(header_bytes.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise RefError(f"{path}: invalid JSON header: {e}") from None
        if not isinstance(header, dict):
            raise RefError(f"{path}: header is not a JSON object")

        self.data_start = 8 + header_len
        data_len = file_size - self.data_start
        self.tensors: Dict[str, dict] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = info["dtype"]
                shape = [int(s) for s in info["shape"]]
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise RefError(f"{path}: malformed header entry for tensor '{name}': {info}") from None
            if dtype not in _ST_DTYPES:
                raise RefError(f"{path}: tensor '{name}' has unsupported dtype {dtype} "
                               f"(supported: {', '.join(_ST_DTYPES)})")
            numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
            nbytes = numel * _ST_DTYPES[dtype].itemsize
            if not (0 <= begin <= end <= data_len) or end - begin != nbytes:
                raise RefError(f"{path}: tensor '{name}' has bad data_offsets [{begin}, {end}] "
                               f"for dtype {dtype} shape {shape} (expected {nbytes} bytes, "
                               f"data buffer is {data_len} bytes)")
            self.tensors[name] = {"dtype": dtype, "shape": shape, "begin": begin, "end": end}
        self._mm = np.memmap(path, dtype=np.uint8, mode="r") if file_size > 0 else None

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str) -> np.ndarray:
        """Return tensor `name` as a float64 numpy array of its stored shape."""
        info = self.tensors[name]
        raw_dtype = _ST_DTYPES[info["dtype"]]
        count = (info["end"] - info["begin"]) // raw_dtype.itemsize
        raw = np.frombuffer(self._mm, dtype=raw_dtype, count=count,
                            offset=self.data_start + info["begin"])
        if info["dtype"] == "BF16":
            raw = bf16_bits_to_float32(raw)
        return raw.astype(np.float64).reshape(info["shape"])


class Checkpoint:
    """All tensors of a model directory (single file or sharded with an index)."""

    INDEX = "model.safetensors.index.json"
    SINGLE = "model.safetensors"

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        index_path = os.path.join(model_dir, self.INDEX)
        single_path = os.path.join(model_dir, self.SINGLE)
        self._files: Dict[str, SafetensorsFile] = {}
        self._where: Dict[str, str] = {}  # tensor name -> file name
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise RefError(f"{index_path}: cannot read weight_map: {e}") from None
            for fname in sorted(set(weight_map.values())):
                fpath = os.path.join(model_dir, fname)
                if not os.path.isfile(fpath):
                    raise RefError(f"shard '{fname}' listed in {self.INDEX} not found in {model_dir}")
                self._files[fname] = SafetensorsFile(fpath)
            for name, fname in weight_map.items():
                if name not in self._files[fname]:
                    raise RefError(f"{self.INDEX} maps tensor '{name}' to '{fname}', "
                                   f"but that shard does not contain it")
                self._where[name] = fname
        elif os.path.isfile(single_path):
            self._files[self.SINGLE] = SafetensorsFile(single_path)
            for name in self._files[self.SINGLE].tensors:
                self._where[name] = self.SINGLE
        else:
            raise RefError(f"no weights in {model_dir}: expected {self.SINGLE} or {self.INDEX}")

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: List[int]) -> torch.Tensor:
        """Load tensor `name` as float64, checking that it has exactly `shape`.

        With `weight_dtype` set, matrices (2-D tensors) are first rounded the
        way pdserve stores them for --weight-dtype (round_weights)."""
        if name not in self._where:
            raise RefError(f"tensor '{name}' not found in {self.model_dir}")
        sf = self._files[self._where[name]]
        stored = sf.tensors[name]["shape"]
        if list(stored) != list(shape):
            raise RefError(f"tensor '{name}' has shape {stored}, expected {list(shape)}")
        values = sf.read(name)
        if self.weight_dtype and len(shape) == 2:
            values = round_weights(values, self.weight_dtype)
        return torch.from_numpy(values)

    weight_dtype: Optional[str] = None


def round_weights(w: np.ndarray, dtype: str) -> np.ndarray:
    """What pdserve keeps for a [rows, cols] matrix under --weight-dtype, as
    float64 values: bf16/fp16 round to nearest even; int8 is symmetric per
    row, scale = max|row| / 127 and q = rint(w * (1 / scale)) in [-127, 127],
    all in float32 arithmetic as in kernels/cpu/packed_gemm.cc."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if dtype in ("auto", "fp32"):
        return w.astype(np.float64)
    if dtype == "fp16":
        return w.astype(np.float16).astype(np.float64)
    if dtype == "bf16":
        u = w.view(np.uint32).astype(np.uint64)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return (u.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dtype == "int8":
        amax = np.abs(w).max(axis=1).astype(np.float32)
        scale = (amax / np.float32(127.0)).astype(np.float32)
        inv = np.where(scale > 0, np.float32(1.0) / np.where(scale > 0, scale, 1),
                       0).astype(np.float32)
        q = np.clip(np.rint(w * inv[:, None]), -127, 127).astype(np.float32)
        return q.astype(np.float64) * scale.astype(np.float64)[:, None]
    if dtype == "int8-b32":
        return round_int8_block32(w)
    raise RefError(f"unknown weight dtype '{dtype}'")


def round_int8_block32(w: np.ndarray) -> np.ndarray:
    """--weight-dtype int8-b32: per row and block of 32 columns (the last one
    may be shorter), scale = max|block| / 127 in float32 rounded UP to fp16
    (nearest even first, then one fp16 step up if below; saturating at 65504)
    and q = rint(w / scale) in [-127, 127] (0 where the scale is 0), as
    WeightMatrix::Pack does; returns q * scale as float64 (exact)."""
    rows, cols = w.shape
    out = np.zeros((rows, cols), dtype=np.float64)
    for b0 in range(0, cols, 32):
        blk = w[:, b0:b0 + 32]
        want = (np.abs(blk).max(axis=1) / np.float32(127.0)).astype(np.float32)
        with np.errstate(over="ignore"):
            h = want.astype(np.float16)
        h = np.where(np.isinf(h), np.float16(65504.0), h).astype(np.float16)
        up = (h.astype(np.float32) < want) & (h < np.float16(65504.0))
        h = np.where(up, np.nextafter(h, np.float16(np.inf)), h).astype(np.float16)
        scale = h.astype(np.float32)
        safe = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
        q = np.where(scale[:, None] > 0,
                     np.clip(np.rint(blk / safe[:, None]), -127, 127), 0).astype(np.float32)
        out[:, b0:b0 + 32] = q.astype(np.float64) * scale.astype(np.float64)[:, None]
    return out


# --------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------

@dataclass
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    tie_word_embeddings: bool
    qkv_bias: bool      # q/k/v projections have a bias
    o_bias: bool        # o_proj has a bias (Llama attention_bias=true)
    qk_norm: bool       # RMSNorm of each q/k head before RoPE (Qwen3)
    max_position_embeddings: Optional[int]
    # Mixture of experts: "mixtral" | "qwen3_moe" | None (dense).
    moe: Optional[str] = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple = ()
    # DeepSeek-V2/V3 (MLA attention + DeepSeek MoE): the config fields, as a
    # dict (see load_deepseek); None for every other family.
    deepseek: Optional[dict] = None

    def is_moe_layer(self, i: int) -> bool:
        if self.deepseek is not None:  # DeepseekV2DecoderLayer's rule
            ds = self.deepseek
            return (self.num_experts > 0 and i >= ds["first_k_dense_replace"]
                    and i % ds["moe_layer_freq"] == 0)
        # transformers' Qwen3MoeDecoderLayer; Mixtral: every layer.
        return (self.moe is not None and self.num_experts > 0
                and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)


def load_config(model_dir: str) -> LlamaConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isdir(model_dir):
        raise RefError(f"model directory not found: {model_dir}")
    try:
        with open(path) as f:
            c = json.load(f)
    except OSError as e:
        raise RefError(f"cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise RefError(f"{path}: invalid JSON: {e}") from None
    return load_config_dict(c, path)


def load_config_dict(c: dict, path: str = "config.json") -> LlamaConfig:
    """A parsed config.json; `path` names it in errors."""
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "vocab_size"):
        if key not in c:
            raise RefError(f"{path}: missing required field '{key}'")
    hidden = int(c["hidden_size"])
    heads = int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    archs = c.get("architectures") or []
    deepseek = load_deepseek(c, archs, path)
    head_dim = c.get("head_dim")
    if deepseek is not None:  # MLA: a head's q/k width; V3 configs write rope dim here
        head_dim = deepseek["qk_nope_head_dim"] + deepseek["qk_rope_head_dim"]
    if head_dim is None:
        if hidden % heads:
            raise RefError(f"{path}: hidden_size {hidden} not divisible by num_attention_heads {heads}")
        head_dim = hidden // heads
    head_dim = int(head_dim)
    if heads % kv_heads:
        raise RefError(f"{path}: num_attention_heads {heads} not divisible by num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise RefError(f"{path}: head_dim {head_dim} must be even for RoPE")
    act = c.get("hidden_act", "silu")
    if act != "silu":
        raise RefError(f"{path}: unsupported hidden_act '{act}' (only silu)")

    is_qwen2 = "Qwen2ForCausalLM" in archs or c.get("model_type") == "qwen2"
    is_mixtral = "MixtralForCausalLM" in archs or c.get("model_type") == "mixtral"
    is_qwen3_moe = "Qwen3MoeForCausalLM" in archs or c.get("model_type") == "qwen3_moe"
    is_qwen3 = (is_qwen3_moe or "Qwen3ForCausalLM" in archs
                or c.get("model_type") == "qwen3")
    attention_bias = bool(c.get("attention_bias", False))
    moe = {}
    if is_mixtral:  # defaults as transformers' MixtralConfig
        moe = dict(moe="mixtral",
                   num_experts=int(c.get("num_local_experts", 8)),
                   num_experts_per_tok=int(c.get("num_experts_per_tok", 2)),
                   moe_intermediate_size=int(c["intermediate_size"]),
                   norm_topk_prob=True)
    elif is_qwen3_moe:  # defaults as transformers' Qwen3MoeConfig
        moe = dict(moe="qwen3_moe",
                   num_experts=int(c.get("num_experts", 128)),
                   num_experts_per_tok=int(c.get("num_experts_per_tok", 8)),
                   moe_intermediate_size=int(c.get("moe_intermediate_size", 768)),
                   norm_topk_prob=bool(c.get("norm_topk_prob", False)),
                   decoder_sparse_step=int(c.get("decoder_sparse_step", 1)),
                   mlp_only_layers=tuple(int(l) for l in (c.get("mlp_only_layers") or [])))
    if deepseek is not None:
        moe = dict(moe="deepseek",
                   num_experts=deepseek["n_routed_experts"],
                   num_experts_per_tok=deepseek["num_experts_per_tok"],
                   moe_intermediate_size=deepseek["moe_intermediate_size"],
                   norm_topk_prob=deepseek["norm_topk_prob"])
        if moe["num_experts"] == 0:
            moe = {}
    if moe and not 1 <= moe["num_experts_per_tok"] <= moe["num_experts"]:
        raise RefError(f"{path}: num_experts_per_tok must be in [1, num_experts]")

    return LlamaConfig(
        hidden_size=hidden,
        intermediate_size=int(c["intermediate_size"]),
        num_hidden_layers=int(c["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(c["vocab_size"]),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(c.get("rope_theta", 10000.0)),
        rope_scaling=c.get("rope_scaling"),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias or is_qwen2,
        # HF LlamaAttention: o_proj uses bias=config.attention_bias; Qwen2's o_proj never has one.
        o_bias=attention_bias and not is_qwen2 and not is_qwen3,
        qk_norm=is_qwen3,
        max_position_embeddings=c.get("max_position_embeddings"),
        deepseek=deepseek,
        **moe,
    )


def load_deepseek(c: dict, archs: list, path: str) -> Optional[dict]:
    """DeepSeek-V2/V3 fields with the defaults of DeepseekV2Config /
    DeepseekV3Config (modeling_deepseek.py's trust_remote_code configs)."""
    v2 = "DeepseekV2ForCausalLM" in archs or c.get("model_type") == "deepseek_v2"
    v3 = "DeepseekV3ForCausalLM" in archs or c.get("model_type") == "deepseek_v3"
    if not (v2 or v3):
        return None

    def get(key, default):
        v = c.get(key)
        return default if v is None else v

    ds = dict(
        version=3 if v3 else 2,
        q_lora_rank=int(get("q_lora_rank", 0)),
        kv_lora_rank=int(get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(get("qk_rope_head_dim", 64)),
        v_head_dim=int(get("v_head_dim", 128)),
        n_routed_experts=int(get("n_routed_experts", 0)),
        num_experts_per_tok=int(get("num_experts_per_tok", 0)),
        moe_intermediate_size=int(get("moe_intermediate_size", 1407)),
        n_shared_experts=int(get("n_shared_experts", 0)),
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
        topk_method=get("topk_method", "noaux_tc" if v3 else "greedy"),
        scoring_func=get("scoring_func", "sigmoid" if v3 else "softmax"),
        n_group=int(get("n_group", 1)),
        topk_group=int(get("topk_group", 1)),
        norm_topk_prob=bool(get("norm_topk_prob", v3)),
        first_k_dense_replace=int(get("first_k_dense_replace", 0)),
        moe_layer_freq=int(get("moe_layer_freq", 1)),
        rope_interleave=bool(get("rope_interleave", True)),
    )
    if ds["topk_method"] not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise RefError(f"{path}: unsupported topk_method {ds['topk_method']}")
    if ds["scoring_func"] not in ("softmax", "sigmoid"):
        raise RefError(f"{path}: unsupported scoring_func {ds['scoring_func']}")
    if ds["qk_rope_head_dim"] % 2:
        raise RefError(f"{path}: qk_rope_head_dim must be even")
    return ds


# --------------------------------------------------------------------------
# model math
# --------------------------------------------------------------------------

def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """inv_freq[i] = 1/theta^(2i/head_dim), i in [0, head_dim/2), with optional rope_scaling."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling
    if not rs:
        return inv_freq
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rs["factor"])
    if rope_type != "llama3":
        raise RefError(f"unsupported rope_scaling type '{rope_type}' (supported: default, linear, llama3)")
    try:
        factor = float(rs["factor"])
        low = float(rs["low_freq_factor"])
        high = float(rs["high_freq_factor"])
        orig = float(rs["original_max_position_embeddings"])
    except KeyError as e:
        raise RefError(f"llama3 rope_scaling is missing field {e}") from None
    # Same as transformers' _compute_llama3_parameters.
    low_freq_wavelen = orig / low
    high_freq_wavelen = orig / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention(cfg: LlamaConfig, ckpt: Checkpoint, i: int, x: torch.Tensor,
              cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Causal GQA self-attention of layer i. x: [T, hidden] -> [T, hidden]."""
    T = x.shape[0]
    H, KV, D, E = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    p = f"model.layers.{i}.self_attn."

    def proj(name, n_heads):
        y = x @ ckpt.get(p + name + ".weight", [n_heads * D, E]).T
        if cfg.qkv_bias:
            y = y + ckpt.get(p + name + ".bias", [n_heads * D])
        return y.view(T, n_heads, D).transpose(0, 1)  # [heads, T, D]

    q, k, v = proj("q_proj", H), proj("k_proj", KV), proj("v_proj", KV)
    if cfg.qk_norm:  # Qwen3: normalise each head over head_dim, before RoPE
        q = rms_norm(q, ckpt.get(p + "q_norm.weight", [D]), cfg.rms_norm_eps)
        k = rms_norm(k, ckpt.get(p + "k_norm.weight", [D]), cfg.rms_norm_eps)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    group = H // KV  # query head h uses kv head h // group
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)

    scores = (q @ k.transpose(1, 2)) / math.sqrt(D)  # [H, T, T]
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [H, T, D]
    out = out.transpose(0, 1).reshape(T, H * D)
    y = out @ ckpt.get(p + "o_proj.weight", [E, H * D]).T
    if cfg.o_bias:
        y = y + ckpt.get(p + "o_proj.bias", [E])
    return y


def mlp(cfg: LlamaConfig, ckpt: Checkpoint, i: int, x: torch.Tensor) -> torch.Tensor:
    E, F = cfg.hidden_size, cfg.intermediate_size
    p = f"model.layers.{i}.mlp."
    gate = x @ ckpt.get(p + "gate_proj.weight", [F, E]).T
    up = x @ ckpt.get(p + "up_proj.weight", [F, E]).T
    return (torch.nn.functional.silu(gate) * up) @ ckpt.get(p + "down_proj.weight", [E, F]).T


def swiglu(ckpt: Checkpoint, x: torch.Tensor, gate: str, up: str, down: str,
           E: int, F: int) -> torch.Tensor:
    g = x @ ckpt.get(gate + ".weight", [F, E]).T
    u = x @ ckpt.get(up + ".weight", [F, E]).T
    return (torch.nn.functional.silu(g) * u) @ ckpt.get(down + ".weight", [E, F]).T


def moe_mlp(cfg: LlamaConfig, ckpt: Checkpoint, i: int, x: torch.Tensor) -> torch.Tensor:
    """Sparse MoE block: softmax router over all experts, top-k (ties to the
    lower expert id), optionally renormalised over the chosen, and the chosen
    experts' SwiGLU outputs summed with those weights. Every expert is run on
    every token here (simple, not fast); only the chosen ones are summed."""
    E, F, N, K = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    if cfg.moe == "mixtral":
        p = f"model.layers.{i}.block_sparse_moe."
        names = lambda e: (f"{p}experts.{e}.w1", f"{p}experts.{e}.w3", f"{p}experts.{e}.w2")
    else:
        p = f"model.layers.{i}.mlp."
        names = lambda e: tuple(f"{p}experts.{e}.{n}" for n in ("gate_proj", "up_proj", "down_proj"))
    probs = torch.softmax(x @ ckpt.get(p + "gate.weight", [N, E]).T, dim=-1)  # [T, N]
    top_p, top_e = torch.sort(probs, dim=-1, descending=True, stable=True)
    top_p, top_e = top_p[:, :K], top_e[:, :K]
    if cfg.norm_topk_prob:
        top_p = top_p / top_p.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(N):
        weight = (top_p * (top_e == e)).sum(dim=-1, keepdim=True)  # [T, 1], 0 if not chosen
        if bool((top_e == e).any()):
            out = out + weight * swiglu(ckpt, x, *names(e), E, F)
    return out


# --------------------------------------------------------------------------
# DeepSeek-V2/V3: MLA attention and DeepSeek MoE, as modeling_deepseek.py
# computes them (K and V expanded from the latent for every position; no
# weight absorption here, unlike pdserve's model/mla.cc).
# --------------------------------------------------------------------------

def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def deepseek_rope(cfg: LlamaConfig, T: int):
    """cos, sin [T, qk_rope_head_dim] of DeepseekV2RotaryEmbedding, or of
    DeepseekV2YarnRotaryEmbedding (with its mscale factor) for rope_scaling
    type yarn."""
    ds = cfg.deepseek
    dim, base = ds["qk_rope_head_dim"], cfg.rope_theta
    idx = torch.arange(0, dim, 2, dtype=torch.float64)
    inv_freq = 1.0 / (base ** (idx / dim))
    factor_cs = 1.0
    rs = cfg.rope_scaling
    if rs:
        kind = rs.get("type", rs.get("rope_type"))
        if kind != "yarn":
            raise RefError(f"unsupported DeepSeek rope_scaling type '{kind}' (supported: yarn)")
        factor = float(rs["factor"])
        orig = float(rs.get("original_max_position_embeddings", 4096))
        beta_fast = float(rs.get("beta_fast", 32))
        beta_slow = float(rs.get("beta_slow", 1))
        mscale = float(rs.get("mscale", 1))
        mscale_all_dim = float(rs.get("mscale_all_dim", 0))

        def correction_dim(rotations):
            return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))
        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
        extrapolate = 1.0 - ramp  # 1: keep the original frequency
        inv_freq = (inv_freq / factor) * (1 - extrapolate) + inv_freq * extrapolate
        factor_cs = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
    t = torch.arange(T, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * factor_cs, emb.sin() * factor_cs


def deepseek_apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        interleave: bool = True) -> torch.Tensor:
    """modeling_deepseek.py's apply_rotary_pos_emb: de-interleave the pairs
    (x[2i], x[2i+1]) into two halves, then rotate_half RoPE (interleave False:
    rotate_half directly, transformers' rope_interleave=False). x: [..., T, d]."""
    *lead, T, d = x.shape
    if interleave:
        x = x.reshape(*lead, T, d // 2, 2).transpose(-1, -2).reshape(*lead, T, d)
    return x * cos + rotate_half(x) * sin


def mla_softmax_scale(cfg: LlamaConfig) -> float:
    ds = cfg.deepseek
    scale = (ds["qk_nope_head_dim"] + ds["qk_rope_head_dim"]) ** -0.5
    rs = cfg.rope_scaling
    if rs and float(rs.get("mscale_all_dim", 0)):
        m = yarn_get_mscale(float(rs["factor"]), float(rs["mscale_all_dim"]))
        scale = scale * m * m
    return scale


def mla_attention(cfg: LlamaConfig, ckpt: Checkpoint, i: int, x: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepseekV2Attention of layer i. x: [T, hidden] -> [T, hidden]."""
    ds = cfg.deepseek
    T, E, H = x.shape[0], cfg.hidden_size, cfg.num_attention_heads
    nope, rope, vd = ds["qk_nope_head_dim"], ds["qk_rope_head_dim"], ds["v_head_dim"]
    R, QL = ds["kv_lora_rank"], ds["q_lora_rank"]
    qh = nope + rope
    p = f"model.layers.{i}.self_attn."
    if QL:
        qa = x @ ckpt.get(p + "q_a_proj.weight", [QL, E]).T
        qa = rms_norm(qa, ckpt.get(p + "q_a_layernorm.weight", [QL]), cfg.rms_norm_eps)
        q = qa @ ckpt.get(p + "q_b_proj.weight", [H * qh, QL]).T
    else:
        q = x @ ckpt.get(p + "q_proj.weight", [H * qh, E]).T
    q = q.view(T, H, qh).transpose(0, 1)  # [H, T, qh]
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    ckv = x @ ckpt.get(p + "kv_a_proj_with_mqa.weight", [R + rope, E]).T  # [T, R + rope]
    latent, k_pe = ckv[:, :R], ckv[:, R:]
    latent = rms_norm(latent, ckpt.get(p + "kv_a_layernorm.weight", [R]), cfg.rms_norm_eps)
    kv = latent @ ckpt.get(p + "kv_b_proj.weight", [H * (nope + vd), R]).T
    kv = kv.view(T, H, nope + vd).transpose(0, 1)  # [H, T, nope + v]
    k_nope, v = kv[..., :nope], kv[..., nope:]
    il = ds["rope_interleave"]
    q_pe = deepseek_apply_rope(q_pe, cos, sin, il)
    k_pe = deepseek_apply_rope(k_pe.view(1, T, rope), cos, sin, il).expand(H, T, rope)
    qs = torch.cat((q_nope, q_pe), dim=-1)
    ks = torch.cat((k_nope, k_pe), dim=-1)
    scores = (qs @ ks.transpose(1, 2)) * mla_softmax_scale(cfg)  # [H, T, T]
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [H, T, v]
    out = out.transpose(0, 1).reshape(T, H * vd)
    return out @ ckpt.get(p + "o_proj.weight", [E, H * vd]).T


def topk_stable(values: torch.Tensor, k: int):
    """Top-k along the last dim, descending, equal values to the lower index."""
    v, idx = torch.sort(values, dim=-1, descending=True, stable=True)
    return v[..., :k], idx[..., :k]


def deepseek_moe(cfg: LlamaConfig, ckpt: Checkpoint, i: int, x: torch.Tensor) -> torch.Tensor:
    """DeepseekV2MoE / DeepseekV3MoE: MoEGate routing (softmax or sigmoid;
    greedy, group_limited_greedy or noaux_tc), the chosen experts weighted,
    plus the shared experts. Every expert runs on every token here."""
    ds = cfg.deepseek
    T, E = x.shape
    N, K, F = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    p = f"model.layers.{i}.mlp."
    logits = x @ ckpt.get(p + "gate.weight", [N, E]).T  # [T, N]
    scores = torch.softmax(logits, dim=-1) if ds["scoring_func"] == "softmax" else torch.sigmoid(logits)
    method = ds["topk_method"]
    choice = scores
    if method == "noaux_tc":
        choice = scores + ckpt.get(p + "gate.e_score_correction_bias", [N])[None, :]
    if method in ("group_limited_greedy", "noaux_tc"):
        G = ds["n_group"]
        grouped = choice.view(T, G, N // G)
        if method == "group_limited_greedy":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = topk_stable(grouped, 2)[0].sum(dim=-1)
        _, group_idx = topk_stable(group_scores, ds["topk_group"])
        group_mask = torch.zeros(T, G, dtype=torch.bool)
        group_mask.scatter_(1, group_idx, True)
        score_mask = group_mask[:, :, None].expand(T, G, N // G).reshape(T, N)
        choice = choice.masked_fill(~score_mask, 0.0)
    top_w, top_e = topk_stable(choice, K)
    if method == "noaux_tc":
        top_w = scores.gather(1, top_e)
    scale = ds["routed_scaling_factor"]
    if K > 1 and ds["norm_topk_prob"]:
        top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
        if ds["version"] == 3:
            top_w = top_w * scale
    else:
        top_w = top_w * scale
    out = torch.zeros_like(x)
    for e in range(N):
        weight = (top_w * (top_e == e)).sum(dim=-1, keepdim=True)
        if bool((top_e == e).any()):
            ep = f"{p}experts.{e}."
            out = out + weight * swiglu(ckpt, x, ep + "gate_proj", ep + "up_proj", ep + "down_proj", E, F)
    if ds["n_shared_experts"]:
        sp = p + "shared_experts."
        out = out + swiglu(ckpt, x, sp + "gate_proj", sp + "up_proj", sp + "down_proj",
                           E, F * ds["n_shared_experts"])
    return out


def forward(cfg: LlamaConfig, ckpt: Checkpoint, tokens: List[int]) -> torch.Tensor:
    """Logits for every position: float64 tensor [T, vocab_size]."""
    if not tokens:
        raise RefError("need at least one token")
    for t in tokens:
        if not 0 <= t < cfg.vocab_size:
            raise RefError(f"token id {t} out of range [0, {cfg.vocab_size})")
    E, V = cfg.hidden_size, cfg.vocab_size
    T = len(tokens)

    embed = ckpt.get("model.embed_tokens.weight", [V, E])
    x = embed[torch.tensor(tokens, dtype=torch.long)]  # [T, E]

    if cfg.deepseek is not None:
        cos, sin = deepseek_rope(cfg, T)
        attn, sparse = mla_attention, deepseek_moe
    else:
        positions = torch.arange(T, dtype=torch.float64)
        angles = positions[:, None] * rope_inv_freq(cfg)[None, :]  # [T, D/2]
        emb = torch.cat((angles, angles), dim=-1)  # [T, D]
        cos, sin = emb.cos(), emb.sin()
        attn, sparse = attention, moe_mlp

    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, ckpt.get(p + "input_layernorm.weight", [E]), cfg.rms_norm_eps)
        x = x + attn(cfg, ckpt, i, h, cos, sin)
        h = rms_norm(x, ckpt.get(p + "post_attention_layernorm.weight", [E]), cfg.rms_norm_eps)
        x = x + (sparse(cfg, ckpt, i, h) if cfg.is_moe_layer(i) else mlp(cfg, ckpt, i, h))

    x = rms_norm(x, ckpt.get("model.norm.weight", [E]), cfg.rms_norm_eps)
    if cfg.tie_word_embeddings or not ckpt.has("lm_head.weight"):
        if not cfg.tie_word_embeddings:
            raise RefError("tensor 'lm_head.weight' not found (and tie_word_embeddings is false)")
        lm_head = embed
    else:
        lm_head = ckpt.get("lm_head.weight", [V, E])
    return x @ lm_head.T


def reference_logits(model_dir: str, tokens: List[int], all_positions: bool = False,
                     weight_dtype: Optional[str] = None):
    """Logits as plain Python lists: [vocab] (last position) or [T][vocab].
    weight_dtype: round matrices as pdserve's --weight-dtype does first."""
    cfg = load_config(model_dir)
    ckpt = Checkpoint(model_dir)
    ckpt.weight_dtype = weight_dtype
    with torch.no_grad():
        logits = forward(cfg, ckpt, tokens)
    return logits.tolist() if all_positions else logits[-1].tolist()


def parse_tokens(text: str) -> List[int]:
    try:
        tokens = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise RefError(f"--tokens must be comma-separated integers, got '{text}'") from None
    if not tokens:
        raise RefError("--tokens is empty")
    return tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face model directory")
    ap.add_argument("--tokens", required=True, help="comma-separated token ids, e.g. 1,2,3")
    ap.add_argument("--all-positions", action="store_true",
                    help="print logits for every position instead of only the last")
    args = ap.parse_args(argv)
    try:
        logits = reference_logits(args.model, parse_tokens(args.tokens), args.all_positions)
    except RefError as e:
        print(f"llama_ref: error: {e}", file=sys.stderr)
        return 1
    json.dump({"logits": logits}, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
