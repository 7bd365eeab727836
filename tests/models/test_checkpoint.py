import ast
import re
from pathlib import Path

import pytest
import torch

import mmgeo
from mmgeo.data import ShapesWorld
from mmgeo.models.checkpoint import load_model, save_model


def _scores(model):
    ds = ShapesWorld("test", image_size=32, size=4)
    t = model.encode_text([c for i in range(4) for c in ds[i][1]])
    i = model.encode_image([ds[i][0] for i in range(4)])
    return model.score(t, i), model.score(t, i, "global")


def test_save_load_gives_identical_scores(tmp_path, tiny_model):
    path = save_model(tiny_model, tmp_path / "m.pt")
    loaded = mmgeo.load_model(path)
    assert not loaded.training and loaded.cfg == tiny_model.cfg
    for a, b in zip(_scores(tiny_model), _scores(loaded)):
        assert torch.equal(a, b)


def test_preprocessing_travels_with_the_checkpoint(tmp_path, tiny_overrides):
    model = mmgeo.create_model("geo-tiny", **{**tiny_overrides, "image_mean": (0.1, 0.2, 0.3)})
    loaded = load_model(save_model(model, tmp_path / "m.pt"))
    assert loaded.cfg.image_mean == (0.1, 0.2, 0.3) and loaded.cfg.image_std == (0.5, 0.5, 0.5)


def test_lightning_style_checkpoint_loads(tmp_path, tiny_model):
    from mmgeo.models.checkpoint import model_record

    state = {f"model.{k}": v for k, v in tiny_model.state_dict().items()}
    torch.save({"state_dict": state, "mmgeo": model_record(tiny_model), "global_step": 3}, tmp_path / "last.ckpt")
    loaded = load_model(tmp_path / "last.ckpt")
    assert torch.equal(_scores(loaded)[0], _scores(tiny_model)[0])


def test_unsafe_or_foreign_files_are_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"config": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="weights_only"):
        load_model(tmp_path / "evil.pt")
    torch.save({"weights": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="no mmgeo model"):
        load_model(tmp_path / "other.pt")
    with pytest.raises(FileNotFoundError, match="train one"):
        load_model(tmp_path / "missing.pt")


# --- checkpoints from outside: safetensors, or torch.load(weights_only=True); never unpickled blindly ---

class _Payload:
    """Unpickling this creates ``marker``: stands in for any code a malicious checkpoint would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_malicious_pickle_is_refused_and_runs_nothing(tmp_path, tiny_model, zipfile):
    from mmgeo.models.checkpoint import model_record

    def evil(name):
        path, marker = tmp_path / f"{name}.pt", tmp_path / f"{name}.marker"
        ckpt = {**model_record(tiny_model), "state_dict": tiny_model.state_dict(), "extra": _Payload(marker)}
        torch.save(ckpt, path, _use_new_zipfile_serialization=zipfile)
        return path, marker

    live, live_marker = evil("live")
    torch.load(live, weights_only=False)  # the payload is real: an unsafe load runs it
    assert live_marker.exists()
    path, marker = evil("model")
    with pytest.raises(ValueError) as err:
        load_model(path)
    msg = str(err.value)
    assert str(path) in msg and "needs code to load" in msg and re.search(r"it names \S*open", msg)
    assert "mmgeo.save_model(model, 'model.safetensors')" in msg and "weights_only=True" in msg
    assert not marker.exists()


def _outputs(model):
    ds = ShapesWorld("test", image_size=32, size=3)
    texts = model.encode_text([c for i in range(3) for c in ds[i][1][:2]])
    images = model.encode_image([ds[i][0] for i in range(3)])
    return [x for e in (texts, images) for x in (e.pooled, e.attn, e.value, e.mask) if x is not None]


@pytest.mark.parametrize("name", ["geo-tiny", "clip-tiny"])
def test_safetensors_round_trip_is_exact(tmp_path, name, tiny_overrides):
    torch.manual_seed(0)
    model = mmgeo.create_model(name, **{**tiny_overrides, "image_mean": (0.1, 0.2, 0.3)}).eval()
    path = mmgeo.save_model(model, tmp_path / "model.safetensors")
    assert path.read_bytes()[8:9] == b"{" and not list(tmp_path.glob("*.tmp"))  # safetensors, written atomically
    loaded = load_model(path)
    assert loaded.cfg == model.cfg and loaded.cfg.image_mean == (0.1, 0.2, 0.3) and not loaded.training
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for x, y in zip(_outputs(model), _outputs(loaded)):
        assert torch.equal(x, y)
    assert len(_outputs(model)) == (8 if name == "geo-tiny" else 2)


def test_format_is_detected_by_content_not_suffix(tmp_path, tiny_model):
    st = mmgeo.save_model(tiny_model, tmp_path / "a.safetensors")
    pt = mmgeo.save_model(tiny_model, tmp_path / "b.pt")
    assert pt.read_bytes()[:2] == b"PK"
    for src, dst in ((st, tmp_path / "st_named.pt"), (pt, tmp_path / "pt_named.safetensors")):
        dst.write_bytes(src.read_bytes())
        assert torch.equal(_outputs(load_model(dst))[0], _outputs(tiny_model)[0])
    (tmp_path / "notes.safetensors").write_text("not a model\n")
    with pytest.raises(ValueError, match="notes.safetensors is neither a safetensors file nor a torch checkpoint"):
        load_model(tmp_path / "notes.safetensors")


def test_tied_weights_survive_safetensors(tmp_path, tiny_model):
    from safetensors import safe_open

    layer = tiny_model.text_encoder.encoder.layer[0].attention.self
    layer.key.weight = layer.query.weight  # tie two parameters: safetensors refuses shared storage as is
    path = mmgeo.save_model(tiny_model, tmp_path / "tied.safetensors")
    with safe_open(path, "pt") as f:
        stored = set(f.keys())
    tied = {"text_encoder.encoder.layer.0.attention.self.key.weight",
            "text_encoder.encoder.layer.0.attention.self.query.weight"}
    assert len(stored & tied) == 1  # one copy on disk
    loaded = load_model(path)
    assert all(torch.equal(loaded.state_dict()[k], layer.query.weight) for k in tied)
    for x, y in zip(_outputs(tiny_model), _outputs(loaded)):
        assert torch.equal(x, y)


def test_partially_overlapping_tensors_are_copied_apart():
    from safetensors.torch import load, save

    from mmgeo.models.checkpoint import _unshare

    base = torch.arange(6.0).reshape(2, 3)
    tensors, aliases = _unshare({"whole": base, "row": base[1]})
    assert aliases == {} and set(tensors) == {"whole", "row"}
    back = load(save(tensors))  # safetensors accepts them: no shared memory left
    assert torch.equal(back["row"], base[1]) and torch.equal(back["whole"], base)


def test_safetensors_without_our_record_or_of_another_version_is_refused(tmp_path, tiny_model):
    import json

    from safetensors.torch import save_file

    from mmgeo.models.checkpoint import model_record

    state = {k: v.contiguous() for k, v in tiny_model.state_dict().items()}
    save_file(state, tmp_path / "bare.safetensors")
    with pytest.raises(ValueError, match="bare.safetensors is a safetensors file without mmgeo's model record"):
        load_model(tmp_path / "bare.safetensors")
    for name, record in (("v2", {**model_record(tiny_model), "version": 2}),
                         ("other", {**model_record(tiny_model), "format": "other"})):
        save_file(state, tmp_path / f"{name}.safetensors", metadata={"mmgeo": json.dumps(record)})
        with pytest.raises(ValueError, match=f"{name}.safetensors is not an mmgeo v1 checkpoint"):
            load_model(tmp_path / f"{name}.safetensors")
    save_file(state, tmp_path / "junk.safetensors", metadata={"mmgeo": "{not json"})
    with pytest.raises(ValueError, match="junk.safetensors: the model record .* is not valid JSON"):
        load_model(tmp_path / "junk.safetensors")
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "bare.safetensors").read_bytes()[:-100])
    with pytest.raises(ValueError, match="cut.safetensors is a damaged safetensors file"):
        load_model(tmp_path / "cut.safetensors")


def test_eval_reads_a_safetensors_checkpoint(tmp_path, tiny_model):
    import eval as eval_app

    ckpt = mmgeo.save_model(tiny_model, tmp_path / "model.safetensors")
    result = eval_app.main(["--ckpt", str(ckpt), "--limit", "3", "--batch-size", "8"])
    assert result["model"] == str(ckpt) and result["counts"] == {"images": 3, "captions": 15}


# --- static guard: no code in the product unpickles blindly ---

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ["mmgeo", "serve", "benchmarks", "data", "scripts", "train.py", "eval.py"]


def unsafe_loads(source: str, filename: str = "<src>") -> list[str]:
    """Lines that may unpickle code: ``torch.load`` without a literal ``weights_only=True``, any
    ``pickle``/``dill``/``joblib`` load or Unpickler, ``numpy.load(allow_pickle=True)``, ``torch.jit.load``."""
    tree = ast.parse(source, filename)
    aliases = {}  # local name -> module it stands for (import torch as th; from pickle import loads)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                            for a in node.names})
        elif isinstance(node, ast.ImportFrom) and node.module:
            aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})

    def dotted(f) -> str:
        parts = []
        while isinstance(f, ast.Attribute):
            parts.append(f.attr)
            f = f.value
        if not isinstance(f, ast.Name):
            return ""
        return ".".join([aliases.get(f.id, f.id), *reversed(parts)])

    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name, kw = dotted(node.func), {k.arg: k.value for k in node.keywords}
        where = f"{filename}:{node.lineno}: {name}"
        literal_true = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
        if name == "torch.load" and not literal_true:
            bad.append(f"{where} without weights_only=True")
        elif name.split(".")[0] in {"pickle", "_pickle", "cPickle", "dill", "joblib"} and \
                name.split(".")[-1] in {"load", "loads", "Unpickler"}:
            bad.append(f"{where} unpickles")
        elif name == "numpy.load" and "allow_pickle" in kw and not (
                isinstance(kw["allow_pickle"], ast.Constant) and kw["allow_pickle"].value is False):
            bad.append(f"{where} with allow_pickle")
        elif name in {"torch.jit.load", "torch.package.PackageImporter"}:
            bad.append(f"{where} runs serialized code")
    return bad


@pytest.mark.parametrize("line", [
    "import torch\ntorch.load(p)",
    "import torch\ntorch.load(p, map_location='cpu', weights_only=False)",
    "import torch as th\nth.load(p, weights_only=flag)",
    "from torch import load\nload(p)",
    "import pickle\npickle.load(f)",
    "from pickle import loads as l\nl(b)",
    "import pickle\npickle.Unpickler(f).load()",
    "import joblib\njoblib.load(p)",
    "import numpy as np\nnp.load(p, allow_pickle=True)",
    "import torch\ntorch.jit.load(p)",
])
def test_unsafe_load_checker_catches_violations(line):
    assert unsafe_loads(line)


def test_unsafe_load_checker_passes_safe_calls():
    ok = ("import torch, numpy as np\ntorch.load(p, map_location='cpu', weights_only=True)\n"
          "np.load(p, mmap_mode='r')\nnp.load(p, allow_pickle=False)\nimport json\njson.load(f)\nmodel.load(p)\n")
    assert unsafe_loads(ok) == []


def test_no_product_code_unpickles_blindly():
    files = [p for entry in PRODUCT for p in ([ROOT / entry] if entry.endswith(".py") else
                                              sorted((ROOT / entry).rglob("*.py")))]
    assert len(files) > 20 and ROOT / "mmgeo" / "models" / "checkpoint.py" in files
    bad = [b for p in files for b in unsafe_loads(p.read_text(), str(p.relative_to(ROOT)))]
    assert bad == []


def test_load_weights_copies_a_checkpoint_into_a_model_of_the_same_config(tmp_path, tiny_model, tiny_overrides):
    from mmgeo.models.checkpoint import load_weights

    path = save_model(tiny_model, tmp_path / "m.pt")
    fresh = mmgeo.create_model("geo-tiny", **tiny_overrides).eval()
    assert any(not torch.equal(a, b) for a, b in zip(_scores(fresh), _scores(tiny_model)))
    load_weights(fresh, path)
    for a, b in zip(_scores(fresh), _scores(tiny_model)):
        assert torch.equal(a, b)


def test_load_weights_names_the_fields_that_differ(tmp_path, tiny_model, tiny_overrides):
    from mmgeo.models.checkpoint import load_weights

    path = save_model(tiny_model, tmp_path / "m.pt")
    other = mmgeo.create_model("geo-tiny", **{**tiny_overrides, "image_conv_stem": True})
    with pytest.raises(ValueError, match=r"image_conv_stem: False there, True here"):
        load_weights(other, path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_weights(other, tmp_path / "missing.pt")
