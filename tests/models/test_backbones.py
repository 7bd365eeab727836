"""Named backbones built offline through the project's factory: transformers (local dir), timm, open_clip.

Each builds random-init from a config (no weights, no network), takes its preprocessing from the
backbone's own config, trains one step, and round-trips through a checkpoint; missing downloads
end in the one MissingDownloadError message.
"""

import pytest
import torch
from PIL import Image

import mmgeo
from mmgeo.models.hub import MissingDownloadError
from mmgeo.training.losses import retrieval_loss
from tests import openclip_tiny
from tests.conftest import TINY

WORDS = ["a", "dog", "cat", "runs", "on", "the", "grass", "red", "ball", "man", "with", "hat"]
CAPTIONS = ["a dog runs on the grass", "a man with a red hat", "a cat", "the red ball on the grass"]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A tiny BERT config + WordPiece vocab tokenizer saved like a Hub model folder."""
    from transformers import BertConfig, BertTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-bert")
    vocab = folder / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s"]) + "\n")
    BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(folder)
    BertConfig(vocab_size=len(WORDS) + 6, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64, max_position_embeddings=64).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def openclip_arch(tmp_path_factory):
    return openclip_tiny.register(tmp_path_factory.mktemp("oc"))


def _backbone(kind, bert_dir, openclip_arch) -> dict:
    if kind == "transformers":
        return {"text_backbone": bert_dir, "text_pretrained": False}
    if kind == "timm":
        return {"image_backbone": "vit_base_patch16_224.augreg2_in21k_ft_in1k", "image_pretrained": False}
    return {"image_backbone": f"openclip:{openclip_arch}", "image_pretrained": False}


@pytest.mark.parametrize("kind,mean", [("transformers", None), ("timm", (0.5, 0.5, 0.5)),
                                       ("open_clip", (0.48145466, 0.4578275, 0.40821073))])
def test_backbone_builds_offline_trains_a_step_and_round_trips(kind, mean, bert_dir, openclip_arch, tmp_path):
    torch.manual_seed(0)
    model = mmgeo.create_model("geo-tiny", **{**TINY, **_backbone(kind, bert_dir, openclip_arch)})
    if mean is not None:  # preprocessing from the backbone's own config, kept in the model's config
        assert model.cfg.image_mean == pytest.approx(mean)
    images = [Image.new("RGB", (50, 40), (40 * i, 90, 200 - 40 * i)) for i in range(len(CAPTIONS))]
    pixels = torch.stack([model.preprocess(im) for im in images])  # (B, 3, 32, 32)
    tok = model.tokenize(CAPTIONS)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = retrieval_loss(model.logits(*model(tok["input_ids"], tok["attention_mask"], pixels)), 1.0)["loss"]
    loss.backward()
    opt.step()
    assert torch.isfinite(loss)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    tower = "text_encoder." if kind == "transformers" else "image_encoder."
    assert any(k.startswith(tower) for k in changed)  # the named backbone itself trained
    path = mmgeo.save_model(model, tmp_path / "model.pt")
    again = mmgeo.load_model(path)
    assert (again.cfg.image_mean, again.cfg.image_interpolation) == (model.cfg.image_mean, "bicubic")
    model.eval()
    torch.testing.assert_close(again.encode_image(images).pooled, model.encode_image(images).pooled)


def test_image_backbone_args_reach_timm_and_round_trip(tmp_path):
    """``image_backbone_args`` go to timm.create_model (a RoPE ViT's layer scale started at 1, not its 1e-5), travel
    in the checkpoint, and may not set what the config's own fields set."""
    torch.manual_seed(0)
    args = {"image_backbone": "vit_small_patch16_rope_mixed_ape_224", "image_backbone_args": {"init_values": 1.0}}
    model = mmgeo.create_model("geo-tiny", **{**TINY, **args}).eval()
    assert type(model.image_encoder).__name__ == "Eva"
    assert all(bool((b.gamma_1 == 1.0).all()) for b in model.image_encoder.blocks)
    again = mmgeo.load_model(mmgeo.save_model(model, tmp_path / "model.pt"))
    assert again.cfg.image_backbone_args == {"init_values": 1.0}
    images = [Image.new("RGB", (40, 40), (200, 40 * i, 90)) for i in range(2)]
    torch.testing.assert_close(again.encode_image(images).pooled, model.encode_image(images).pooled)
    with pytest.raises(ValueError, match="sets depth, embed_dim: give image_depth, image_embed_dim instead"):
        mmgeo.create_model("geo-tiny", **{**TINY, "image_backbone_args": {"depth": 2, "embed_dim": 64}})


def test_missing_downloads_name_what_to_fetch():
    with pytest.raises(MissingDownloadError, match="huggingface-cli download mmgeo-test/no-such-bert"):
        mmgeo.create_model("geo-tiny", **{**TINY, "text_backbone": "mmgeo-test/no-such-bert"})
    with pytest.raises(MissingDownloadError, match="download timm/vit_tiny_patch16_224.augreg_in21k`"):
        mmgeo.create_model("geo-tiny", **{**TINY, "image_backbone": "vit_tiny_patch16_224.augreg_in21k",
                                          "image_pretrained": True})


def test_openclip_tower_needs_a_tag_for_weights(openclip_arch):
    with pytest.raises(ValueError, match="names no open_clip weights"):
        mmgeo.create_model("geo-tiny", **{**TINY, "image_backbone": f"openclip:{openclip_arch}",
                                          "image_pretrained": True})


class _Payload:
    """Unpickling this creates ``marker``: stands in for any code a malicious weights file would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _same(tower: torch.nn.Module, state: dict) -> bool:
    got = tower.state_dict()
    return set(state) <= set(got) and all(torch.equal(got[k], v) for k, v in state.items())


@pytest.mark.parametrize("kind", ["transformers", "timm", "open_clip"])
def test_local_weights_load_and_malicious_ones_are_refused(kind, bert_dir, openclip_arch, tmp_path):
    """Each library's real formats (safetensors, and a torch pickle of tensors) load through our factory;
    a pickle that names code is refused with UnsafeWeightsError before anything runs."""
    import shutil

    import open_clip
    from safetensors.torch import save_file

    from mmgeo.models.hub import UnsafeWeightsError

    torch.manual_seed(0)
    folder, marker = tmp_path / "weights", tmp_path / "ran.marker"
    if kind == "transformers":
        shutil.copytree(bert_dir, folder)
        tower = mmgeo.create_model("geo-tiny", **{**TINY, "text_backbone": str(folder),
                                                  "text_pretrained": False}).text_encoder
        tower.save_pretrained(folder)  # model.safetensors, as the Hub has it
        files = {"safetensors": folder / "model.safetensors", "torch": folder / "pytorch_model.bin"}
        overrides, part = {"text_backbone": str(folder), "text_pretrained": True}, "text_encoder"
    elif kind == "timm":
        folder.mkdir()
        (folder / "config.json").write_text('{"architecture": "vit_tiny_patch16_224", "num_classes": 0}')
        tower = mmgeo.create_model("geo-tiny", **TINY).image_encoder
        files = {"safetensors": folder / "model.safetensors", "torch": folder / "pytorch_model.bin"}
        overrides, part = {"image_backbone": f"local-dir:{folder}", "image_pretrained": True}, "image_encoder"
    else:
        folder.mkdir()
        tower = open_clip.create_model(openclip_arch)
        files = {"safetensors": folder / "clip.safetensors", "torch": folder / "clip.pt"}
        part = "image_encoder.visual"
    state = {k: v.detach().clone().contiguous() for k, v in tower.state_dict().items()}
    for fmt, path in files.items():
        save_file(state, path) if fmt == "safetensors" else torch.save(state, path)
        if kind == "open_clip":
            overrides = {"image_backbone": f"openclip:{openclip_arch}/{path}", "image_pretrained": True}
        model = mmgeo.create_model("geo-tiny", **{**TINY, **overrides})
        expect = state if kind != "open_clip" else {  # the image tower; its CLIP projection is dropped
            k[len("visual."):]: v for k, v in state.items() if k.startswith("visual.") and k != "visual.proj"}
        assert _same(model.get_submodule(part), expect), fmt
        path.unlink()
    torch.save({**state, "extra": _Payload(marker)}, files["torch"])
    with pytest.raises(UnsafeWeightsError, match=r"refused: .*needs code to load \(it names \S*open\).*safetensors"):
        mmgeo.create_model("geo-tiny", **{**TINY, **overrides})
    assert not marker.exists()
