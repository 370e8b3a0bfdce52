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


def test_the_corpus_is_its_documents_joined():
    documents = data.load_documents()
    assert len(documents) > 50 and data.load_corpus() == "\n\n".join(documents)


def test_document_split_holds_out_whole_documents_from_all_over_the_corpus():
    documents = [f"document {i} " + "x" * (10 + 7 * (i % 5)) for i in range(60)]
    train, val = data.document_split(documents, val_fraction=0.2, seed=3)
    assert sorted(train + val) == sorted(documents) and not set(train) & set(val)  # each in exactly one part
    assert [d for d in documents if d in set(train)] == train  # training keeps the corpus's order
    total = sum(map(len, documents))
    assert 0.15 * total < sum(map(len, val)) <= 0.2 * total  # filled close to, never past, the fraction
    held = sorted(documents.index(d) for d in val)
    assert held[0] < 20 and held[-1] >= 40  # not a tail: from the whole corpus
    assert data.document_split(documents, 0.2, seed=3) == (train, val)
    assert data.document_split(documents, 0.2, seed=4) != (train, val)


def test_document_split_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="val_fraction must be in"):
        data.document_split(["a", "b"], 1.0)
    with pytest.raises(ValueError, match="at least 2 documents"):
        data.document_split(["only one"], 0.1)
    with pytest.raises(ValueError, match="no document fits in 10%"):
        data.document_split(["a" * 50, "b" * 50], 0.1)


def test_keep_frequent_tokens_ranks_by_frequency_and_shares_the_last_id():
    """Against a count by hand: rank by frequency in the reference (ties by id, unseen tokens after every seen one),
    ranks at or past vocab_size - 1 all become vocab_size - 1."""
    from collections import Counter

    reference = torch.randint(0, 50, (2_000,), generator=torch.Generator().manual_seed(0)) ** 2 % 97
    ids = torch.randint(0, 120, (500,), generator=torch.Generator().manual_seed(1))
    counts = Counter(reference.tolist())
    order = sorted(range(120), key=lambda t: (-counts[t], t))
    for vocab_size in (2, 10, 60, 200):
        expected = [min(order.index(t), vocab_size - 1) for t in ids.tolist()]
        assert data.keep_frequent_tokens(ids, reference, vocab_size).tolist() == expected
    with pytest.raises(ValueError, match="at least 2"):
        data.keep_frequent_tokens(ids, reference, 1)
