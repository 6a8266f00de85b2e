"""Export a mounted model version as one GGUF file llama.cpp loads.

Scope: the inverse of :mod:`store.models.gguf_source` for the architectures of
:mod:`store.models.gguf`. Every tensor keeps its stored values when its format
has a GGUF type, and nothing is requantized:

=================  =====================================================
stored format      GGUF type
=================  =====================================================
f32 / f16 / bf16   F32 / F16 / BF16 (1-D tensors and routers as F32, as
                   llama.cpp's converter writes them: exact widening)
q4 (groups of 32)  Q4_1 (``d q + m`` with fp16 ``d``, ``m``: the same numbers)
q8 (groups of 32)  Q8_0 when every group is symmetric (``m = -128 d``, as a
                   GGUF Q8_0 mounted natively is); else refused
anything else      refused (:class:`~store.models.gguf.UnsupportedGGUFError`)
=================  =====================================================

DeepSeek's ``kv_b_proj`` is written as llama.cpp's ``attn_k_b`` / ``attn_v_b``
halves (a quantized store format of it is refused: the k half is its transpose);
where mount rebuilt it as float32 from quantized halves, each half gets the type
the source file gave it back if, and only if, re-encoding reproduces the stored
values exactly (it does for the values a Q8_0/Q4_0 dequantized to).

Qwen3-Next and Jamba are written as their converter transforms them: ``in_proj_qkvz``
as ``attn_qkv`` / ``attn_gate``, conv1d squeezed, ``A_log`` as ``ssm_a = -exp(A_log)``
and Qwen3-Next's norms as ``1 + w``, computed as the converter computes them for a
version mounted from safetensors and written back as they are for one mounted from
GGUF (which holds llama.cpp's own values: byte-exact both ways).

Routed experts are stacked per layer as ``ffn_{gate,up,down}_exps``; q/k rows
of ``llama``-arch models (Mixtral) are permuted to llama.cpp's rope order; the
mounted ``tokenizer.json`` (byte-level BPE) becomes the ``tokenizer.ggml.*``
vocabulary. Every extent read is checksum-verified. The version's format
history (source format, conversions) is recorded under ``czyx.format_history``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from czyx.space import Selector
from czyx.store.core.checksum import checksum
from czyx.store.errors import ChecksumError
from czyx.store.models.archs import (
    FILE_ROLES,
    NORMS_HOLD_ONE_PLUS,
    ONE_PLUS_ROLES,
    SIDE_FILES,
    TOKENIZER_ROLE,
)
from czyx.store.models.checkpoint import DTYPES
from czyx.store.models.export import Progress, chat_template, format_history, staged_file
from czyx.store.models.gguf import (
    ROPE_FREQS,
    UnsupportedGGUFError,
    config_rope_type,
    gguf_metadata,
    gguf_name,
    gguf_tokenizer_fields,
    kv_b_split,
    llama3_rope_freqs,
    qk_permute,
    qkvz_dims,
    qkvz_split,
)
from czyx.store.models.gguf_source import _to_bf16
from czyx.store.models.model import ModelSpace
from czyx.store.quant.formats import get_format, is_quant_format, views

_STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def _q() -> Any:
    import gguf

    return gguf.GGMLQuantizationType


def to_gguf_blocks(buf: np.ndarray, fmt_name: str, shape: tuple[int, int], what: str) -> tuple:
    """``(uint8 [R, row bytes], GGML type)`` of a packed store matrix, without loss.

    Raises
    ------
    UnsupportedGGUFError
        A format with no exact GGUF type (see the module docstring).
    """
    fmt = get_format(fmt_name)
    if fmt.group_size != 32 or fmt.bits not in (4, 8):
        raise UnsupportedGGUFError(f"{what}: format {fmt.name} has no GGUF type")
    rows, cols = shape
    codes, d, m = views(buf, fmt, shape)
    dbytes = np.ascontiguousarray(d).view(np.uint8).reshape(rows, -1, 2)
    if fmt.bits == 8:
        if not np.array_equal(m.astype(np.float32), d.astype(np.float32) * -128):
            raise UnsupportedGGUFError(
                f"{what}: asymmetric q8 groups have no GGUF type (Q8_0 is d * q)"
            )
        q = codes.reshape(rows, cols // 32, 32)
        qs = q ^ np.uint8(0x80)  # the bits of q - 128 as int8
        blocks = np.concatenate([dbytes, qs], axis=2)
        return blocks.reshape(rows, -1), _q().Q8_0
    # Q4_1 blocks, 20 bytes: d, m (fp16), then 16 bytes of code pairs, filled in place.
    groups = cols // 32
    blocks = np.empty((rows, groups, 20), np.uint8)
    b16 = blocks.view(np.uint16)  # [rows, groups, 10]
    b16[:, :, 0] = np.ascontiguousarray(d).view(np.uint16).reshape(rows, groups)
    b16[:, :, 1] = np.ascontiguousarray(m).view(np.uint16).reshape(rows, groups)
    _q4_1_nibbles(codes, rows, cols, blocks[:, :, 4:].reshape(rows, groups, 8, 2))
    return blocks.reshape(rows, -1), _q().Q4_1


_LOW = np.uint64(0x0F0F0F0F0F0F0F0F)


def _q4_1_nibbles(codes: np.ndarray, rows: int, cols: int, out: np.ndarray) -> None:
    """Q4_1's ``qs`` (byte j of a block: code j | code j + 16 << 4) from the store's q4
    bytes (byte k of a group: code 2k | code 2k + 1 << 4), nibble by nibble without
    unpacking, eight bytes a word, into ``out`` ``[rows, groups, 8, 2]`` (byte pairs
    qs[2i], qs[2i + 1])."""
    w = np.ascontiguousarray(codes).view(np.uint64).reshape(rows, cols // 32, 2)
    lo, hi = w[:, :, 0], w[:, :, 1]  # a group's codes 0..15 and 16..31, two a byte
    four = np.uint64(4)
    even = (lo & _LOW) | ((hi & _LOW) << four)  # qs[0], qs[2], ...: the low nibbles
    odd = ((lo >> four) & _LOW) | (hi & ~_LOW)  # qs[1], qs[3], ...: the high ones
    np.stack(
        [even.view(np.uint8).reshape(rows, -1, 8), odd.view(np.uint8).reshape(rows, -1, 8)],
        axis=3,
        out=out,
    )


def _float_tensor(raw: np.ndarray, dtype: str, shape: tuple[int, ...]) -> tuple[np.ndarray, Any]:
    arr = raw.view(DTYPES[dtype][0]).reshape(shape)
    if dtype == "F32":
        return arr, _q().F32
    if dtype == "F16":
        return arr, _q().F16
    if dtype == "BF16":
        return arr, _q().BF16
    raise UnsupportedGGUFError(f"dtype {dtype} has no GGUF export")


def _widen(arr: np.ndarray, qt: Any) -> np.ndarray:
    if qt == _q().BF16:
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32)


def export_gguf(
    store: Any,
    ref: str | Selector,
    out: str | os.PathLike[str],
    progress: Progress | None = None,
) -> list[Path]:
    """Write model version ``ref`` as a GGUF file.

    The tensors stream to the file one at a time (the trunk's one tensor, the routed
    experts one layer at a time), so a version bigger than memory exports; the file
    is written under a temporary name beside ``out`` and renamed into place once
    complete, so a failed export leaves nothing behind.

    Parameters
    ----------
    store
        An open :class:`store.Store`.
    ref
        ``NAME@VERSION``, 64-hex selector or :class:`Selector`.
    out
        A ``*.gguf`` path, or a directory (created) that gets ``model.gguf``.
    progress
        Called with (tensor bytes written, total) after each tensor.

    Raises
    ------
    UnsupportedGGUFError
        The architecture, a config feature or a stored format has no GGUF form.
    """
    import gguf

    space = ModelSpace(store, ref)
    config = space.root["config"]
    arch, meta = gguf_metadata(config)
    path = Path(out)
    if path.suffix != ".gguf":
        path = path / "model.gguf"
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    tokenizer = None
    kept: dict[str, bytes] = {}  # the side files, by role
    recurrent = {layer for role, layer in space.trunk if role in ("lin_qkvz", "mamba_in_proj")}
    trunk: list[tuple[str, str, Any]] = []  # (GGUF name, role, record): converted as written
    for (role, layer), tref in sorted(
        space.trunk.items(), key=lambda kv_: (kv_[0][1] is not None, kv_[0][1] or 0, kv_[0][0])
    ):
        if role == TOKENIZER_ROLE:
            tokenizer = space.read_trunk_raw(tref).tobytes().decode("utf-8")
        elif role in FILE_ROLES:  # kept files (generation/tokenizer config): no GGUF tensor
            kept[role] = space.read_trunk_raw(tref).tobytes()
        elif arch.gguf == "deepseek2" and role == "kv_b_proj":  # written as its two halves
            trunk.append((f"blk.{layer}.attn_k_b.weight", "kv_b_proj:k", tref))
            trunk.append((f"blk.{layer}.attn_v_b.weight", "kv_b_proj:v", tref))
        elif role == "lin_qkvz":  # written as the converter splits it
            trunk.append((f"blk.{layer}.attn_qkv.weight", "lin_qkvz:qkv", tref))
            trunk.append((f"blk.{layer}.attn_gate.weight", "lin_qkvz:z", tref))
        else:
            trunk.append((gguf_name(arch, role, layer, layer in recurrent), role, tref))
    if config_rope_type(config) == "llama3":  # LlamaModel.generate_extra_tensors: first, F32
        trunk.insert(0, (ROPE_FREQS, "rope_freqs:llama3", None))
    source_types = (space.root.get("source") or {}).get("tensor_types") or {}

    def trunk_tensor(name: str, role: str, tref: Any) -> tuple[np.ndarray, Any]:
        if role == "rope_freqs:llama3":
            return llama3_rope_freqs(config), _q().F32
        raw = space.read_trunk_raw(tref)
        shape = tuple(tref.shape)
        qfmt = tref.record.get("qfmt")
        if role.startswith("kv_b_proj:"):
            return _kv_b_half(raw, tref, qfmt, config, role[-1], source_types.get(name), name)
        if qfmt is not None and role in _CONVERTED:
            raise UnsupportedGGUFError(f"{name}: a {qfmt} {role} (llama.cpp's is F32)")
        if qfmt is not None:
            data, qt = to_gguf_blocks(raw, qfmt, (shape[0], shape[1]), name)
        else:
            data, qt = _float_tensor(raw, tref.dtype, shape)
            if role in _CONVERTED:  # Qwen3-Next / Jamba: as the converter writes them
                data, qt = _converted(data, qt, role, config), _q().F32
            elif data.ndim == 1 or role == "router" or role == "shared_expert_gate":
                data, qt = _widen(data, qt), _q().F32
            if role == "shared_expert_gate":
                data = data.reshape(-1)
        if arch.permute_qk and role in ("q_proj", "k_proj"):
            data = data[qk_permute(shape[0], heads if role == "q_proj" else kv)]
        if role.startswith("lin_qkvz:"):
            data = qkvz_split(data, qkvz_dims(config))[role.endswith(":z")]
        return np.ascontiguousarray(data), qt

    with _ExpertStacks(space) as stacks, staged_file(path) as tmp:
        writer = gguf.GGUFWriter(tmp, arch.gguf)
        for key, value in meta.items():
            _add_kv(writer, key, value)
        writer.add_string("czyx.format_history", json.dumps(format_history(space.root)))
        template = chat_template(space.root) or _checkpoint_chat_template(kept)
        if template is not None:
            writer.add_chat_template(template)
        if tokenizer is not None:
            _add_tokenizer(writer, tokenizer, int(config["vocab_size"]))
        for field, key in (
            ("bos_token_id", "add_bos_token_id"),
            ("eos_token_id", "add_eos_token_id"),
            ("pad_token_id", "add_pad_token_id"),
        ):
            v = config.get(field)
            if isinstance(v, list):
                v = v[0] if v else None
            if v is not None:
                getattr(writer, key)(int(v))
        # Every tensor's info first (the header holds them all), from its converted form:
        # the trunk's are made here and dropped, the expert stacks' from one expert each.
        total = 0
        for name, role, tref in trunk:
            data, qt = trunk_tensor(name, role, tref)
            total += _add_info(writer, name, data.shape, data.dtype, data.nbytes, qt)
        for name, shape, dtype, nbytes, qt in stacks.infos():
            total += _add_info(writer, name, shape, dtype, nbytes, qt)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        done = 0
        for name, role, tref in trunk:
            data, _ = trunk_tensor(name, role, tref)
            writer.write_tensor_data(data)
            done += data.nbytes
            if progress is not None:
                progress(done, total)
        for layer in stacks.layers:
            for data in stacks.layer(layer):
                writer.write_tensor_data(data)
                done += data.nbytes
                if progress is not None:
                    progress(done, total)
        writer.close()
    return [path]


# Roles whose HF values the converter transforms (Qwen3NextModel / JambaModel), all
# written F32: A_log as -exp(A_log), conv1d squeezed, Qwen3-Next's norms as 1 + w.
_CONVERTED = frozenset({"lin_a_log", "mamba_a_log", "lin_conv", "mamba_conv", *ONE_PLUS_ROLES})


def _converted(data: np.ndarray, qt: Any, role: str, config: dict) -> np.ndarray:
    """The F32 values the converter writes for ``role`` (see :data:`_CONVERTED`).

    It computes in the checkpoint's own dtype and then widens (1-D tensors and conv1d are
    F32 in its files), so each value is rounded to the stored type before widening. Its
    ``-torch.exp`` is computed here as the float64 exponential rounded to float32: the
    correctly rounded value, where torch's vectorised float32 exp may be an ulp off (so
    an export's ``ssm_a`` is within an ulp of the converter's, and does not depend on
    which torch or CPU the converter ran on).
    A GGUF source's own values (``lin_neg_a``, and norms under ``NORMS_HOLD_ONE_PLUS``)
    are not in this set or skip it: they go back as they are.
    """
    wide = _widen(data, qt)
    if role.endswith("_conv"):
        return wide.reshape(wide.shape[0], -1)
    if role in ONE_PLUS_ROLES:
        if config.get("model_type") != "qwen3_next" or config.get(NORMS_HOLD_ONE_PLUS):
            return wide
        return _rounded(wide + np.float32(1.0), qt)
    return -_rounded(np.exp(wide.astype(np.float64)).astype(np.float32), qt)


def _rounded(values: np.ndarray, qt: Any) -> np.ndarray:
    """float32 ``values`` rounded to the float type ``qt`` (nearest even) and widened back."""
    if qt == _q().F16:
        return values.astype(np.float16).astype(np.float32)
    if qt == _q().BF16:
        return _widen(_to_bf16(values), qt)
    return values.astype(np.float32)


def _add_info(writer: Any, name: str, shape: tuple, dtype: Any, nbytes: int, qt: Any) -> int:
    """One tensor's header entry, as ``GGUFWriter.add_tensor`` makes it; its byte size."""
    raw = None if qt in (_q().F32, _q().F16) else qt  # (F32 / F16: typed by the array)
    writer.add_tensor_info(name, shape, dtype, nbytes, raw_dtype=raw)
    return int(nbytes)


def _add_tokenizer(writer: Any, tokenizer: str, vocab_size: int) -> None:
    fields = gguf_tokenizer_fields(tokenizer, vocab_size)
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    writer.add_token_list(fields["tokenizer.ggml.tokens"])
    writer.add_token_types(fields["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.merges" in fields:
        writer.add_token_merges(fields["tokenizer.ggml.merges"])
    if "tokenizer.ggml.scores" in fields:  # sentencepiece ("llama") vocabulary
        writer.add_token_scores(fields["tokenizer.ggml.scores"])
        writer.add_add_space_prefix(fields["tokenizer.ggml.add_space_prefix"])
        if fields["tokenizer.ggml.unknown_token_id"] is not None:
            writer.add_unk_token_id(fields["tokenizer.ggml.unknown_token_id"])


def _kv_b_half(
    raw: np.ndarray,
    tref: Any,
    qfmt: str | None,
    config: dict,
    half: str,
    source_type: str | None,
    name: str,
) -> tuple[np.ndarray, Any]:
    """deepseek2's ``attn_k_b`` (``half`` "k") or ``attn_v_b`` ("v") of a stored
    ``kv_b_proj``, as the converter splits it.

    A float kv_b_proj keeps its type. One that mount rebuilt as float32 from
    quantized halves (``source_type``, the GGUF type the half had) is written in that
    type again only where re-encoding reproduces the stored values exactly (F16/BF16
    of values they widened to, Q8_0 and Q4_0 of values they dequantized to do);
    otherwise it stays F32.
    """
    import gguf

    if qfmt is not None:  # the k half is the transpose: quant groups would cross heads
        raise UnsupportedGGUFError(
            f"{name}: a {qfmt} kv_b_proj has no GGUF form (llama.cpp's attn_k_b is its "
            "transpose per head)"
        )
    data, qt = _float_tensor(raw, tref.dtype, tuple(tref.shape))
    k_b, v_b = kv_b_split(data, int(config["num_attention_heads"]), int(config["qk_nope_head_dim"]))
    out = np.ascontiguousarray(k_b if half == "k" else v_b)
    want = None if source_type is None else getattr(_q(), source_type, None)
    if qt != _q().F32 or want is None or want == _q().F32:
        return out, qt
    if want == _q().F16:  # a pair of mixed types was joined as F32: F16 again if exact
        half16 = out.astype(np.float16)
        return (half16, want) if np.array_equal(half16.astype(np.float32), out) else (out, qt)
    if want == _q().BF16:
        bits = (out.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
        exact = np.array_equal((bits.astype(np.uint32) << 16).view(np.float32), out)
        return (bits, want) if exact else (out, qt)
    try:
        blocks = gguf.quants.quantize(out, want)
        exact = np.array_equal(gguf.quants.dequantize(blocks, want), out)
    except (NotImplementedError, ValueError):  # a type the package cannot encode
        exact = False
    return (blocks, want) if exact else (out, qt)


def _add_kv(writer: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list):  # (Jamba's per-layer head_count_kv)
        writer.add_array(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_uint32(key, int(value))


class _ExpertStacks:
    """The routed experts as GGUF's per-layer stacks (``ffn_{gate,up,down}_exps``), made
    one layer at a time: every expert of the layer read once (checksum-verified) and
    converted, its three stacks returned; nothing of other layers is held."""

    def __init__(self, space: ModelSpace) -> None:
        ex = space.root["expert"]
        self.space = space
        self.layers = list(ex["sparse_layers"])
        self.inter, self.hidden, self.n = int(ex["inter"]), int(ex["hidden"]), space.n_experts
        self.fmt, self.dtype = ex["format"], ex["dtype"]
        self.readers = [space.store.open_reader(sel) for sel in space.blocks]
        self.buf = np.empty(space.nbytes, np.uint8)

    def __enter__(self) -> _ExpertStacks:
        return self

    def __exit__(self, *exc: object) -> None:
        for r in self.readers:
            r.close()

    def _parts(self, layer: int, e: int) -> list[tuple[np.ndarray, Any]]:
        """Expert ``e`` of ``layer``: each part's GGUF data (a view of the shared buffer
        for float formats: copy to keep) and type."""
        space, buf = self.space, self.buf
        blk = int(space.blk[layer, e])
        self.readers[blk].read_into(int(space.off[layer, e]), buf)
        if checksum(buf) != int(space.sums[layer, e]):
            raise ChecksumError(f"expert ({layer}, {e}): checksum mismatch")
        out = []
        parts = _split(buf, self.fmt, self.inter, self.hidden, self.dtype)
        for i, (part, shape) in enumerate(parts):
            if is_quant_format(self.fmt):
                out.append(to_gguf_blocks(part, self.fmt, shape, f"blk.{layer}.{_STACKS[i]}"))
            else:
                out.append(_float_tensor(part, self.dtype, shape))
        return out

    def infos(self) -> list[tuple[str, tuple, Any, int, Any]]:
        """``(name, shape, dtype, bytes, type)`` of every stack, in write order (from the
        first expert of each layer: the others have the same form)."""
        out = []
        for layer in self.layers:
            for i, (data, qt) in enumerate(self._parts(layer, 0)):
                name = f"blk.{layer}.{_STACKS[i]}.weight"
                out.append((name, (self.n, *data.shape), data.dtype, self.n * data.nbytes, qt))
        return out

    def layer(self, layer: int) -> list[np.ndarray]:
        """The three stacks of ``layer``, each ``[experts, ...]``."""
        stacks: list[np.ndarray] = []
        qts: set = set()
        for e in range(self.n):
            for i, (data, qt) in enumerate(self._parts(layer, e)):
                if e == 0:
                    stacks.append(np.empty((self.n, *data.shape), data.dtype))
                stacks[i][e] = data  # (the buffer is reused: copied in here)
                qts.add(qt)
        if len(qts) != 1:
            raise UnsupportedGGUFError(f"layer {layer}: its experts mix GGUF types {qts}")
        return stacks


def _split(buf: np.ndarray, fmt: str, inter: int, hidden: int, dtype: str) -> list:
    shapes = [(inter, hidden), (inter, hidden), (hidden, inter)]
    if is_quant_format(fmt):
        f = get_format(fmt)
        sizes = [f.nbytes(*s) for s in shapes]
    else:
        sizes = [inter * hidden * DTYPES[dtype][1]] * 3
    pos, out = 0, []
    for size, shape in zip(sizes, shapes, strict=True):
        out.append((buf[pos : pos + size], shape))
        pos += size
    return out


def _checkpoint_chat_template(kept: dict[str, bytes]) -> str | list | None:
    """The chat template a mounted checkpoint kept, where transformers finds it: its
    ``chat_template.jinja``, else its ``tokenizer_config.json``'s ``chat_template`` (a
    list of named templates as it is: the GGUF writer stores each under its name, as
    llama.cpp's converter does). None when it kept neither or the config is unusable."""
    jinja = kept.get(SIDE_FILES["chat_template.jinja"][0])
    if jinja is not None:
        return jinja.decode("utf-8")
    raw = kept.get(SIDE_FILES["tokenizer_config.json"][0])
    try:
        tpl = None if raw is None else json.loads(raw).get("chat_template")
    except (ValueError, AttributeError, RecursionError):
        return None
    return tpl if isinstance(tpl, (str, list)) else None
