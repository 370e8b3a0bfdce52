import hashlib

import pytest
import torch

from helpers.text import data
from helpers.text.data import DownloadError, NextTokenDataset, RemoteText, fetch


def test_default_corpus_is_offline_text():
    text = data.load_corpus()
    assert len(text) > 200_000 and "assert" in text
    ids = data.load_token_ids()
    assert ids.dtype == torch.long and len(ids) > 50_000 and int(ids.max()) < 50257


def test_unknown_corpus_lists_choices():
    with pytest.raises(ValueError, match="valid corpora: python-docs, tiny-shakespeare"):
        data.load_corpus("wikipedia")


@pytest.mark.parametrize(("context", "stride"), [(4, 4), (4, 1), (5, 3), (10, 10)])
def test_windows_are_shifted_slices(context, stride):
    ids = torch.arange(23)
    ds = NextTokenDataset(ids, context, stride)
    starts = range(0, len(ids) - context, stride)
    assert len(ds) == len(starts)
    for i, s in enumerate(starts):
        x, y = ds[i]
        assert torch.equal(x, ids[s : s + context]) and torch.equal(y, ids[s + 1 : s + context + 1])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_too_short_a_corpus_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot fill one window"):
        NextTokenDataset(torch.arange(8), 8)


def test_split_and_loader():
    ids = torch.arange(1000)
    train, val = data.train_val_split(ids, 0.1)
    assert len(train) == 900 and torch.equal(torch.cat([train, val]), ids)
    loader = data.make_dataloader(train, batch_size=4, context_length=16, seed=1)
    x, y = next(iter(loader))
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    again = next(iter(data.make_dataloader(train, batch_size=4, context_length=16, seed=1)))
    assert torch.equal(x, again[0])  # seeded shuffling


def _remote(tmp_path, content: bytes, sha: str | None = None) -> RemoteText:
    src = tmp_path / "source.txt"
    src.write_bytes(content)
    return RemoteText(src.as_uri(), sha or hashlib.sha256(content).hexdigest(), "corpus.txt")


def test_fetch_verifies_and_caches(tmp_path):
    remote = _remote(tmp_path, b"to be or not to be")
    path = fetch(remote, tmp_path / "cache")
    assert path.read_bytes() == b"to be or not to be"
    (tmp_path / "source.txt").unlink()  # the cached copy is used from now on
    assert fetch(remote, tmp_path / "cache") == path
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["corpus.txt"]  # no partial files


def test_fetch_refuses_a_checksum_mismatch(tmp_path):
    remote = _remote(tmp_path, b"tampered", sha="0" * 64)
    with pytest.raises(DownloadError, match="does not match its pinned sha256"):
        fetch(remote, tmp_path / "cache")
    assert not (tmp_path / "cache" / "corpus.txt").exists()


def test_fetch_offline_says_what_to_do(tmp_path):
    remote = RemoteText("http://127.0.0.1:9/corpus.txt", "0" * 64, "corpus.txt")  # nothing listens
    with pytest.raises(DownloadError, match="offline\\? Use the default corpus 'python-docs'"):
        fetch(remote, tmp_path, timeout=5)
