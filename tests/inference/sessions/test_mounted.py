"""Sessions on mounted model versions: ``czyx run --session`` end to end, version refusal."""

from __future__ import annotations

import pytest

from czyx.cli import main
from czyx.inference.engine import Engine
from czyx.inference.sampling import SamplingParams
from czyx.inference.sessions.errors import ModelVersionMismatchError
from czyx.inference.sessions.live import LiveSession
from czyx.inference.sessions.store import SessionStore
from czyx.inference.tokenizer import ByteTokenizer
from czyx.portals import open_model
from czyx.portals.authority import open_authority
from czyx.store import Store
from czyx.store.models.model import open_version as open_consumer
from czyx.store.models.mount import mount
from czyx.testing.tiny_models import make_tiny_checkpoint

CFG = dict(vocab_size=256, max_position_embeddings=512, eos_token_id=None, bos_token_id=None)


@pytest.fixture(scope="module")
def mounted(tmp_path_factory):
    root = tmp_path_factory.mktemp("mounted")
    with Store.open(root / "st") as st:
        for seed, tag in ((0, "tiny@1"), (1, "tiny@2")):
            ckpt = make_tiny_checkpoint("qwen3_moe", root / f"ckpt{seed}", seed=seed, **CFG)
            mount(st, ckpt, tag)
    return root / "st"


def _engine(st: Store, tag: str) -> Engine:
    view = open_model(st, open_authority(st).root_token(), tag)
    return Engine(open_consumer(st, tag, view=view))


def test_run_session_flag_continues_exactly(mounted, capsys):
    common = ["--store", str(mounted), "--session", "talk", "--tenant", "alice"]
    first = "the quick brown fox jumps over the lazy dog; " * 2
    sampled = ["--temperature", "0.8", "--top-k", "40", "--seed", "3"]
    assert main(["run", "tiny@1", "--prompt", first, "--max-tokens", "6", *sampled, *common]) == 0
    err = capsys.readouterr().err
    assert "session talk@1 (started)" in err
    assert main(["run", "tiny@1", "--prompt", " again", "--max-tokens", "6", *common]) == 0
    err = capsys.readouterr().err
    n1 = len(first.encode()) + 6
    assert f"session talk@2 (resumed): {n1} tokens restored" in err
    assert "6 prefilled" in err
    # The same conversation, never interrupted, on the same mounted version.
    with Store.open(mounted) as st:
        ref = LiveSession.start(_engine(st, "tiny@1"), SamplingParams(0.8, 40, 1.0, 3), "alice")
        tok = ByteTokenizer()
        ref.feed(tok.encode(first))
        ref.generate(6)
        ref.feed(tok.encode(" again"))
        ref.generate(6)
        saved = SessionStore.open(st, tenant="alice").tokens("talk").tolist()
        assert saved == ref.tokens
        # The session was saved against tiny@1: tiny@2 refuses it, on load and on run.
        with pytest.raises(ModelVersionMismatchError):
            SessionStore.open(st, tenant="alice").read("talk", model=st.resolve_tag("tiny@2").raw)
    assert main(["run", "tiny@2", "--prompt", "x", *common]) == 1
    assert "model version" in capsys.readouterr().err
