"""Perplexity: llama-perplexity's windows and scoring, checked against cross-entropy computed by hand
from transformers' logits on the same windows."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from tiny_models import TinyModel

from wallbreaker import LLM
from wallbreaker.cli import main
from wallbreaker.errors import InvalidRequestError
from wallbreaker.measure.perplexity import perplexity, token_windows

TEXT = (Path(__file__).parent / "tiny_models.py").read_text()[:6000]
CTX = 64


def hand_perplexity(tiny: TinyModel, ids: list[int], add_bos: bool, bos: int, score: str) -> tuple[float, float, int]:
    """The same windows through transformers, scored by hand: (ppl, llama.cpp's ± of it, tokens)."""
    model = tiny.load_hf()
    nll: list[float] = []
    for i in range(len(ids) // CTX):
        w = ids[i * CTX:(i + 1) * CTX]
        if add_bos:
            w[0] = bos
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([w])).logits[0].double(), dim=-1)  # [CTX, vocab]
        first = CTX // 2 if score == "half" else 0
        nll += [-logp[j, w[j + 1]].item() for j in range(first, CTX - 1)]
    mean = sum(nll) / len(nll)
    var = sum(x * x for x in nll) / len(nll) - mean * mean
    ppl = math.exp(mean)
    return ppl, ppl * math.sqrt(var / (len(nll) - 1)), len(nll)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # llama adds BOS (first token replaced), qwen2 does not
@pytest.mark.parametrize("score", ["half", "all"])
def test_perplexity_matches_cross_entropy_of_transformers_logits(arch: str, score: str,
                                                                 request: pytest.FixtureRequest) -> None:
    tiny: TinyModel = request.getfixturevalue(f"tiny_{arch}")
    llm = LLM(str(tiny.hf_dir), dtype="float32")
    tok = llm.tokenizer
    ids = tok.encode(TEXT)
    assert (ids[0] == tok.bos_token_id) == (arch == "llama") and len(ids) >= 3 * CTX
    result = perplexity(llm, TEXT, ctx=CTX, score=score, progress=False)
    ppl, stderr, count = hand_perplexity(tiny, ids, tok.add_bos, tok.bos_token_id, score)
    assert result.windows == len(ids) // CTX
    assert result.tokens_scored == count == result.windows * (CTX // 2 - 1 if score == "half" else CTX - 1)
    assert result.ppl == pytest.approx(ppl, rel=1e-5)
    assert result.stderr == pytest.approx(stderr, rel=1e-4)


def test_windows_are_whole_and_start_with_bos() -> None:
    ids = list(range(10))
    assert token_windows(ids, 4, None, None) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert token_windows(ids, 4, None, 99) == [[99, 1, 2, 3], [99, 5, 6, 7]]
    assert token_windows(ids, 4, 1, None) == [[0, 1, 2, 3]]
    assert ids == list(range(10))


def test_chunks_limit_the_windows(tiny_qwen2: TinyModel) -> None:
    llm = LLM(str(tiny_qwen2.hf_dir), dtype="float32")
    assert perplexity(llm, TEXT, ctx=CTX, chunks=2, progress=False).windows == 2
    with pytest.raises(InvalidRequestError, match="fewer than one window"):
        perplexity(llm, "too short", ctx=CTX, progress=False)
    with pytest.raises(InvalidRequestError):
        perplexity(llm, TEXT, ctx=CTX, score="some", progress=False)


def test_cli_prints_ppl_as_its_last_line(tiny_llama: TinyModel, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    rc = main(["perplexity", "--model", str(tiny_llama.gguf_path), "--file", str(text), "--ctx", str(CTX),
               "--chunks", "3", "--dtype", "float32"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 0 and re.fullmatch(r"PPL = \d+\.\d{4} \+/- \d+\.\d{5}", last)


def test_cli_missing_file_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(["perplexity", "--file", str(tmp_path / "nope.txt")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith("wallbreaker: error:") and "\n" not in err
