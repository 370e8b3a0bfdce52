"""The course's tokenizer: 2.1's recipe, kept in the course's cache, and the one the later notebooks load."""

import pytest

from helpers.system.files import CACHE_ENV
from helpers.text.bpe import BPETokenizer, train_bpe
from helpers.text.course_tokenizer import (
    course_split,
    course_tokenizer_dir,
    load_course_tokenizer,
    save_course_tokenizer,
    train_course_tokenizer,
)
from helpers.text.data import document_split, load_documents
from helpers.text.tokenizer_files import save_tokenizer_files

VOCAB = 320  # 64 merges: quick to train, enough to tell two tokenizers apart


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path


def test_the_split_is_the_one_the_training_notebooks_make():
    assert course_split() == document_split(load_documents(), val_fraction=0.1, seed=0)


def test_an_empty_cache_gets_the_recipes_tokenizer_and_keeps_it(empty_cache):
    train_docs, val_docs = course_split()
    expected = train_bpe("\n\n".join(train_docs), VOCAB)
    loaded = load_course_tokenizer(VOCAB)
    assert loaded.merges == expected.merges and loaded.special_tokens == {}
    assert course_tokenizer_dir(VOCAB).is_relative_to(empty_cache)
    sample = val_docs[0][:2000]
    assert loaded.encode(sample) == expected.encode(sample) and loaded.decode(loaded.encode(sample)) == sample
    kept = (course_tokenizer_dir(VOCAB) / "merges.txt").stat().st_mtime_ns
    assert load_course_tokenizer(VOCAB).merges == expected.merges
    assert (course_tokenizer_dir(VOCAB) / "merges.txt").stat().st_mtime_ns == kept  # loaded, not trained again


def test_the_tokenizer_the_learner_saved_is_the_one_loaded():
    theirs = train_bpe("\n\n".join(course_split()[1]), VOCAB)  # learned from the validation documents instead
    assert theirs.vocab_size == VOCAB and theirs.merges != train_course_tokenizer(VOCAB).merges
    save_course_tokenizer(theirs)
    assert load_course_tokenizer(VOCAB).merges == theirs.merges


def test_a_tokenizer_with_special_tokens_is_refused():
    with pytest.raises(ValueError, match="no special tokens"):
        save_course_tokenizer(BPETokenizer([], special_tokens={"<|endoftext|>": 256}))


def test_a_folder_of_another_size_is_refused_with_what_to_do():
    save_tokenizer_files(train_course_tokenizer(VOCAB - 1), course_tokenizer_dir(VOCAB))
    with pytest.raises(ValueError, match="delete the folder"):
        load_course_tokenizer(VOCAB)
