"""The cartridge file format: damaged headers and metadata are refused with CartridgeFileError (never another
exception), non-finite cartridges are refused at load, and the package keeps its shape (no import cycle, no
module over 600 lines)."""

import ast
import json
import random
import struct
from pathlib import Path

import pytest
import torch

from cartridges.cache import Cartridge
from cartridges.format import (
    KINDS,
    CartridgeFileError,
    CartridgeMismatchError,
    load_cartridge,
    read_cartridge_file,
    read_header,
)
from zoo.pretrained import tiny_llama

PACKAGE = Path(__file__).resolve().parents[2] / "cartridges"


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def zoo_model():
    from zoo.models.hf import ZooConfig, ZooForCausalLM

    config = ZooConfig(
        n_layers=2,
        pattern=["base_conv", "based"],
        mixers={"based": {"feature_dim": 4, "num_heads": 2, "chunk_size": 16}},
        d_model=32,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return ZooForCausalLM(config).eval().requires_grad_(False)


@pytest.fixture(scope="module")
def files(model, zoo_model, tmp_path_factory):
    """The bytes of one valid file of each kind."""
    from cartridges.state import StateCartridge

    root = tmp_path_factory.mktemp("format")
    ids = torch.randint(3, 259, (1, 12), generator=torch.Generator().manual_seed(1))
    kv = Cartridge.from_prefix(model, ids).save(root / "kv.safetensors")
    state = StateCartridge.from_prefix(zoo_model, ids[0]).save(root / "state.safetensors")
    return {"kv": kv.read_bytes(), "state": state.read_bytes()}


def split(data: bytes) -> tuple[dict, dict, bytes]:
    """(header, metadata, tensor bytes) of a file."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    return header, json.loads(header["__metadata__"]["zoo.cartridge"]), data[8 + n :]


def join(header_text: str, rest: bytes) -> bytes:
    raw = header_text.encode("utf-8", "surrogatepass")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + rest


def rebuild(data: bytes, edit_header=None, edit_meta=None, raw_meta: str | None = None) -> bytes:
    header, meta, rest = split(data)
    if edit_meta is not None:
        meta = edit_meta(meta)
    header["__metadata__"]["zoo.cartridge"] = raw_meta if raw_meta is not None else json.dumps(meta)
    if edit_header is not None:
        header = edit_header(header)
    return join(json.dumps(header), rest)


def first_tensor(header: dict) -> str:
    return next(k for k in sorted(header) if k != "__metadata__")


def edited(field, value):
    def edit(meta):
        meta[field] = value
        return meta

    return edit


def tensor_entry(value):
    def edit(header):
        header[first_tensor(header)] = value(header[first_tensor(header)])
        return header

    return edit


DEEP = "[" * 100_000 + "]" * 100_000
NAMED_DEFECTS = {
    "tensor-without-data_offsets": dict(edit_header=tensor_entry(lambda e: {"dtype": e["dtype"], "shape": e["shape"]})),
    "tensor-entry-an-int": dict(edit_header=tensor_entry(lambda e: 7)),
    "string-offset": dict(edit_header=tensor_entry(lambda e: {**e, "data_offsets": ["0", e["data_offsets"][1]]})),
    "model-a-string": dict(edit_meta=edited("model", "tiny")),
    "model-with-an-extra-key": dict(edit_meta=lambda m: {**m, "model": {**m["model"], "extra": 1}}),
    "num_layers-a-string": dict(edit_meta=edited("num_layers", "2")),
    "num_layers-huge": dict(edit_meta=edited("num_layers", 2**70)),
    "metadata-a-list": dict(raw_meta="[1, 2, 3]"),
    "metadata-deeply-nested": dict(raw_meta=DEEP),
    "weights_sample-of-strings": dict(edit_meta=lambda m: {**m, "model": {**m["model"], "weights_sample": ["a"]}}),
    "num_frozen-over-num_tokens": dict(edit_meta=edited("num_frozen", 10_000)),
    "training_config-a-list": dict(edit_meta=edited("training_config", [])),
    "unknown-kind": dict(edit_meta=edited("kind", "lora")),
}


@pytest.mark.parametrize("defect", list(NAMED_DEFECTS), ids=list(NAMED_DEFECTS))
def test_a_well_formed_but_wrong_header_is_a_file_error(files, model, tmp_path, defect):
    path = tmp_path / "c.safetensors"
    path.write_bytes(rebuild(files["kv"], **NAMED_DEFECTS[defect]))
    with pytest.raises(CartridgeFileError) as info:
        load_cartridge(path, model)
    assert "\n" not in str(info.value)
    with pytest.raises(CartridgeFileError):
        read_header(path)


def test_nested_arrays_in_the_header_are_a_file_error(files, model, tmp_path):
    header, _, rest = split(files["kv"])
    text = json.dumps({**header, "deep": "PLACEHOLDER"}).replace('"PLACEHOLDER"', DEEP)
    path = tmp_path / "c.safetensors"
    path.write_bytes(join(text, rest))
    with pytest.raises(CartridgeFileError):
        load_cartridge(path, model)


def test_a_non_finite_cartridge_is_refused_at_load(model, tmp_path):
    cartridge = Cartridge.random(model, num_tokens=4, num_frozen=0)
    with torch.no_grad():
        cartridge.trainable_keys.fill_(float("nan"))
    path = cartridge.save(tmp_path / "nan.safetensors")
    with pytest.raises(CartridgeFileError, match="NaN or infinite"):
        load_cartridge(path, model)


def test_messages_name_the_file_by_its_label(files, model, tmp_path):
    path = tmp_path / "secret-dir" / "c.safetensors"
    path.parent.mkdir()
    path.write_bytes(files["kv"][:100])
    with pytest.raises(CartridgeFileError) as info:
        read_cartridge_file(path, label="doc")
    assert "doc" in str(info.value) and "secret-dir" not in str(info.value)


JUNK = [None, True, False, -1, 0, 1, 2**70, 1.5, float("nan"), float("inf"), "x", "", [], [1, "a"], {}, {"a": 1}]
JUNK.append([[[]]])


def random_value(rng: random.Random):
    return rng.choice(JUNK)


def mutate_json(rng: random.Random, obj):
    """One random edit somewhere inside `obj` (a dict or list), in place: delete, replace or add."""
    path, node = [], obj
    while isinstance(node, (dict, list)) and node and rng.random() < 0.6:
        key = rng.choice(sorted(node)) if isinstance(node, dict) else rng.randrange(len(node))
        if not isinstance(node[key], (dict, list)) or not node[key]:
            break
        path.append(key)
        node = node[key]
    if isinstance(node, dict):
        keys = sorted(node)
        action = rng.choice(["delete", "replace", "add"]) if keys else "add"
        if action == "add":
            node[rng.choice(["extra", "kind", "checksum", "dtype", "layout", "shape"])] = random_value(rng)
        elif action == "delete":
            del node[rng.choice(keys)]
        else:
            node[rng.choice(keys)] = random_value(rng)
    elif isinstance(node, list):
        if node and rng.random() < 0.5:
            node[rng.randrange(len(node))] = random_value(rng)
        else:
            node.append(random_value(rng))


def mutation(rng: random.Random, data: bytes, family: str) -> bytes:
    header, meta, rest = split(data)
    if family == "metadata":
        for _ in range(rng.randint(1, 3)):
            mutate_json(rng, meta)
        header["__metadata__"]["zoo.cartridge"] = json.dumps(meta)
        return join(json.dumps(header), rest)
    if family == "header":
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        mutate_json(rng, tensors)
        return join(json.dumps({"__metadata__": header["__metadata__"], **tensors}), rest)
    # bytes: flip bytes of the header or its length prefix, or cut the file
    raw = bytearray(data)
    (n,) = struct.unpack("<Q", data[:8])
    choice = rng.random()
    if choice < 0.7:
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(8, 8 + n)] = rng.randrange(256)
    elif choice < 0.85:
        raw[rng.randrange(8)] = rng.randrange(256)
    else:
        raw = raw[: rng.randrange(len(raw))]
    return bytes(raw)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("family", ["metadata", "header", "bytes"])
def test_fuzzed_files_load_cleanly_or_raise_a_file_error(files, model, zoo_model, tmp_path, kind, family):
    """A few hundred random mutations in all: each loads or raises CartridgeFileError (a changed model
    signature may also be a CartridgeMismatchError), never anything else."""
    rng = random.Random(f"{kind}-{family}")
    target = model if kind == "kv" else zoo_model
    path = tmp_path / "c.safetensors"
    outcomes = {"loaded": 0, "refused": 0}
    for _ in range(50):
        path.write_bytes(mutation(rng, files[kind], family))
        try:
            load_cartridge(path, target)
            outcomes["loaded"] += 1
        except (CartridgeFileError, CartridgeMismatchError):
            outcomes["refused"] += 1
        try:
            read_header(path)
        except CartridgeFileError:
            pass
    assert outcomes["refused"] > 0


def imports_of(path: Path) -> set[str]:
    """The cartridges.* modules that `path` imports anywhere (top level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cartridges"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("cartridges"))
    return out


def test_the_package_has_no_import_cycle_and_no_module_over_600_lines():
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = imports_of(path)
        assert len(path.read_text().splitlines()) <= 600, f"{name} is over 600 lines"

    def visit(name, trail):
        if name in trail:
            raise AssertionError("import cycle: " + " -> ".join([*trail[trail.index(name) :], name]))
        for dep in modules.get(name, ()):
            # a package's __init__ imports its own modules: that edge is not a cycle through the module
            if not name.startswith(dep + ".") and dep != name:
                visit(dep, [*trail, name])

    for name in modules:
        visit(name, [])


@pytest.mark.parametrize("reader", ["load", "header"])
def test_random_bytes_are_not_a_cartridge_rather_than_truncated(model, tmp_path, reader):
    """A file of random bytes reads as a header length of some 10^19 bytes: it is not a cartridge, not a truncated
    one (which a copy that stopped early is)."""
    import struct

    path = tmp_path / "x.safetensors"
    path.write_bytes(struct.pack("<Q", 15529117173656317790) + b"\x8f" * 992)
    with pytest.raises(CartridgeFileError, match="is not a cartridge|not a cartridge: a 15529117173656317790-byte"):
        load_cartridge(path, model) if reader == "load" else read_header(path)
