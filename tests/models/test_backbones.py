"""Named backbones built offline through the project's factory: transformers (local dir), timm, open_clip.

Each builds random-init from a config (no weights, no network), takes its preprocessing from the
backbone's own config, trains one step, and round-trips through a checkpoint; missing downloads
end in the one MissingDownloadError message.
"""

import pytest
import torch
from PIL import Image

import mmgeo
from mmgeo.losses import retrieval_loss
from mmgeo.models.towers import MissingDownloadError
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
