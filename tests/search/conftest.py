"""Shared fixtures: a tiny model and its checkpoint, a gallery of 24 synthetic test images, a gallery of a
folder with a corrupt file (built once per session, also for tests/serve)."""

from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from tests.conftest import TINY
from tests.pg import fresh_database, server_url

_ENVS: dict = {}  # one gallery env per session, whichever conftest asks first


def write_folder(folder):
    """Five small PNG/JPEG images of different sizes, one corrupt .png, one non-image .txt."""
    folder.mkdir(parents=True, exist_ok=True)
    colours = ["red", "green", "blue", "yellow", "purple"]
    for i, c in enumerate(colours):
        im = Image.new("RGB", (40 + 8 * i, 32 + 4 * i), "white")
        im.paste(Image.new("RGB", (16, 16), c), (4 * i, 8))
        im.save(folder / (f"img{i}.png" if i % 2 == 0 else f"img{i}.jpg"))
    (folder / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not really a png")
    (folder / "notes.txt").write_text("not an image, ignored by suffix")
    return folder


def encode_test_images(n: int):
    """(a tiny model, the first ``n`` synthetic test images and their captions encoded by it)."""
    import mmgeo
    from mmgeo.data import ShapesWorld
    from mmgeo.eval.retrieval import encode_split

    torch.manual_seed(0)
    model = mmgeo.create_model("geo-tiny", **TINY).eval()
    ds = ShapesWorld("test", 0, image_size=model.cfg.image_size)
    with torch.inference_mode():
        return model, encode_split(model, torch.utils.data.Subset(ds, range(n)), batch_size=64, progress=False)


def make_gallery_env(tmp_path_factory) -> SimpleNamespace:
    """root, ckpt, model (loaded from ckpt), idx (first 24 synthetic test images, as `serve build --data
    synthetic --limit 24` writes it), folder_idx (``write_folder``'s images), folder."""
    if "env" in _ENVS:
        return _ENVS["env"]
    import mmgeo
    from mmgeo.data import ShapesWorld
    from mmgeo.search.build import build_gallery, folder_items

    root = tmp_path_factory.mktemp("gallery")
    torch.manual_seed(0)
    ckpt = mmgeo.save_model(mmgeo.create_model("geo-tiny", **TINY).eval(), root / "tiny.pt")
    model = mmgeo.load_model(ckpt)
    ds = ShapesWorld("test", 0, image_size=model.cfg.image_size)
    idx, folder_idx = root / "idx", root / "folder_idx"
    build_gallery(model, ((None, (lambda i=i: ds[i][0])) for i in range(24)), 24, idx, ckpt=ckpt, batch_size=8,
                  progress=False)
    folder = write_folder(root / "photos")
    items, n = folder_items(folder)
    build_gallery(model, items, n, folder_idx, ckpt=ckpt, progress=False)
    _ENVS["env"] = SimpleNamespace(root=root, ckpt=ckpt, model=model, idx=idx, folder_idx=folder_idx, folder=folder)
    return _ENVS["env"]


@pytest.fixture(scope="session")
def gallery_env(tmp_path_factory):
    return make_gallery_env(tmp_path_factory)


@pytest.fixture(autouse=True, scope="session")
def single_thread_faiss():
    """FAISS' OpenMP spin-waits badly on a busy 2-core machine (IVF training 0.15 s -> 10 s): use one thread."""
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory) -> str:
    """A real PostgreSQL + pgvector for the session (tests/pg.py; skipped without the pgserver wheel)."""
    return server_url(tmp_path_factory)


@pytest.fixture
def pg_url(pg_server) -> str:
    """A fresh empty database on it."""
    return fresh_database(pg_server)


@pytest.fixture(scope="module")
def ranked(gallery_env):
    """The tiny model, its gallery of 24 images, their first captions encoded, and every (caption, image) score."""
    import numpy as np

    from mmgeo.data import ShapesWorld
    from mmgeo.models import Embedding
    from mmgeo.search.store import Gallery

    g = Gallery(gallery_env.idx)
    captions = [ShapesWorld("test", 0, image_size=32)[i][1][0] for i in range(len(g))]
    texts = gallery_env.model.encode_text(captions)
    gallery_emb = Embedding(torch.zeros(len(g), 1), torch.from_numpy(np.array(g.keys, np.float32)),
                            torch.from_numpy(np.array(g.values, np.float32)), torch.from_numpy(np.array(g.mask)))
    exact = gallery_env.model.score(texts, gallery_emb).numpy()  # (N_text, N_image) geometric, every pair
    return gallery_env.model, g, texts, exact
