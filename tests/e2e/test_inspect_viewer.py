"""The trajectory viewer in a real headless browser: `arl inspect --format html` on real shards (tiny tokenizer,
session trees, write_step) and an `arl replay`-shaped Parquet, the page loaded in Debian's chromium through
Playwright, its DOM checked, its filters used, a screenshot kept in tests/artifacts/viewer_step.png."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_inspect_cli import chained_session  # tests/e2e is on sys.path (pytest)

from pipeline.proxy.trajectory import SessionTree
from pipeline.run.paths import RunPaths
from pipeline.run.shards import write_step

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "tests" / "artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
"""Without the background-networking flags chromium dials out at start, and a closed network refuses it."""
SESSIONS = [("s0", "math", 0.0), ("s1", "math", 0.5), ("s2", "code", 1.0), ("s3", "code", 1.0)]


def session(tokenizer: Any, sid: str, task: str, reward: float) -> SessionTree:
    """Reasoning, a tool call, the tool's answer, a reply; s1's reply changes weights after 2 tokens."""
    chat = [{"role": "user", "content": f"Weather in Paris? ({sid})"}]
    p1 = tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)  # fmt: skip
    o1 = tokenizer.encode('<think>hmm, a tool</think><tool_call>{"name": "weather"}</tool_call><|im_end|>',
                          add_special_tokens=False)  # fmt: skip
    suffix = tokenizer.encode("\n<|im_start|>user\n<tool_response>sunny</tool_response><|im_end|>\n"
                              "<|im_start|>assistant\n", add_special_tokens=False)  # fmt: skip
    o2 = tokenizer.encode("It is sunny.<|im_end|>", add_special_tokens=False)
    swap = sid == "s1"
    turns = [(iid, prompt, out, [lp] * len(out), [3] * 2 + [3 + (swap and iid == "b")] * (len(out) - 2))
             for iid, prompt, out, lp in (("a", p1, o1, -0.1), ("b", [*p1, *o1, *suffix], o2, -4.0))]  # fmt: skip
    tree = chained_session(sid, f"g-{task}", {"task": task}, reward, turns)
    if sid != "s3":  # s3's call markup is what a parser would reject: sampled, but not a call
        tree.get(f"{sid}-a").metadata["parsed_tool_calls"] = 1
    return tree


@pytest.fixture(scope="module")
def page_path(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    paths = RunPaths(tmp_path_factory.mktemp("viewer") / "exp" / "trial")
    rows = [
        row
        for sid, task, reward in SESSIONS
        for row in session(tokenizer, sid, task, reward).export("concat", 1.0, step=4)
    ]
    write_step(paths, 4, rows, producer="rollout", tokenizer=str(tiny_model_dir))
    # What `arl replay` writes, for s2 only: the trainer disagrees by 2 nats on its first sampled token.
    s2 = next(r for r in rows if r.session_id == "s2")
    first = s2.prompt_len
    replay = {"run": ["trial"] * 2, "step": [4, 4], "sample_id": [s2.sample_id] * 2, "pos": [first, first + 1],
              "token_id": [s2.input_ids[first], s2.input_ids[first + 1]], "engine_logprob": [-0.1, -0.1],
              "trainer_logprob": [-2.1, -0.1], "delta": [-2.0, 0.0]}  # fmt: skip
    paths.replay_file(4).parent.mkdir(parents=True)
    pq.write_table(pa.table(replay), paths.replay_file(4))
    out = tmp_path_factory.mktemp("pages")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([str(REPO / ".venv" / "bin" / "arl"), "inspect", str(paths.root), "--format", "html",
                             "-o", str(out)], capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out / "step_000004.html")
    return out / "step_000004.html"


@pytest.fixture(scope="module")
def browser() -> Any:
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium (scripts/test.sh installs it: apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra")
    with sync_api.sync_playwright() as play:
        chromium = play.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def rgb(page: Any, selector: str) -> tuple[int, ...]:
    colour = page.eval_on_selector(selector, "e => getComputedStyle(e).backgroundColor")
    return tuple(int(float(c)) for c in colour[colour.index("(") + 1 : -1].split(",")[:3])


def test_the_page_in_a_browser(page_path: Path, browser: Any) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.goto(page_path.as_uri())
    page.wait_for_selector(".card[data-drawn] .tok.s")  # the system turn's tokens start collapsed (hidden)
    page.wait_for_function("document.querySelectorAll('.card[data-drawn]').length === 4")
    assert errors == [] and requests == [page_path.as_uri()]  # self-contained: nothing else is fetched

    assert page.locator(".card").count() == 4 and page.text_content("#count") == "4 of 4 samples"
    first = ".card[data-i='0']"
    assert page.locator(f"{first} .tok.s").count() > 0 and page.locator(f"{first} .tok.p").count() > 0
    for kind in ("think", "call", "resp"):  # found in the chat template's text, on the tokens inside the markup
        assert page.locator(f"{first} .tok.k-{kind}").count() > 0, kind
    assert "It is sunny." in page.text_content(first) and page.locator(f"{first} .turn.assistant").count() == 2
    pills = page.locator(f"{first} .pill.call")
    assert pills.count() == 1 and pills.text_content() == "1 tool call(s)"
    # Each turn's sampled tokens open with what they are trained with: the row's one advantage, every turn alike.
    credit = page.locator(f"{first} .credit").all_text_contents()
    header = next(t for t in page.locator(f"{first} .head span").all_text_contents() if t.startswith("advantage "))
    assert [c.split(" · ")[0] for c in credit] == ["turn 1", "turn 2"]
    assert {c.split(" · ")[1] for c in credit} == {header}
    assert page.locator(".card[data-i='3'] .pill.call").count() == 0, "rejected markup is not a tool call"
    # The template's system turn starts collapsed, so the conversation's turns come first; one click opens it.
    system = page.locator(f"{first} details.sys")
    assert system.count() == 1 and not system.evaluate("d => d.open")
    assert not page.is_visible(f"{first} details.sys .tok") and page.is_visible(f"{first} .turn.user")
    page.click(f"{first} details.sys > summary")
    assert system.evaluate("d => d.open") and page.is_visible(f"{first} details.sys .tok")
    # Only s1's reply changed weights inside the turn; every sample changes 3 -> 4 nowhere else.
    assert page.locator("main .vswap").count() == 1 and page.text_content(".card[data-i='1'] .vswap") == "v3→v4"

    # Default colouring: this step has a replay file, so mismatch; s2's first sampled token is 2 nats off.
    assert page.input_value("#colour") == "mismatch"
    s2_first = ".card[data-i='2'] .tok.s"
    r, g, b = rgb(page, s2_first)
    assert b > g and r > g, (r, g, b)  # purple
    page.select_option("#colour", "lp")
    sure = rgb(page, f"{first} .tok.s.k-think")  # log-prob -0.1
    unsure = rgb(page, f"{first} .body > .tok.s:last-child")  # the reply's last token, log-prob -4.0
    assert sure[1] > sure[0] and unsure[0] > unsure[1], (sure, unsure)  # green vs red
    assert rgb(page, f"{first} .tok.p") == (0, 0, 0)  # loss-masked: no background (transparent)

    page.hover(f"{first} .tok.s.k-think")
    tip = page.text_content("#tip")
    assert page.is_visible("#tip") and "log-prob -0.1000" in tip and "version 3" in tip and "inside reasoning" in tip

    page.fill("#rmin", "0.9")
    assert page.text_content("#count") == "2 of 4 samples" and page.locator(".card[hidden]").count() == 2
    page.fill("#rmin", "")
    page.select_option("#task", "math")
    assert page.text_content("#count") == "2 of 4 samples" and not page.is_visible(".card[data-i='2']")
    page.fill("#q", "(s1)")
    assert page.text_content("#count") == "1 of 4 samples" and page.is_visible(".card[data-i='1']")
    page.select_option("#task", "")
    page.fill("#q", "")
    page.select_option("#has", "swap")
    assert page.text_content("#count") == "1 of 4 samples"
    page.select_option("#has", "call")  # parsed calls only: s3's rejected markup does not count
    assert page.text_content("#count") == "3 of 4 samples" and not page.is_visible(".card[data-i='3']")
    page.select_option("#has", "")
    page.fill("#lmax", "1")
    assert page.text_content("#count") == "0 of 4 samples"
    page.fill("#lmax", "")

    ARTIFACTS.mkdir(exist_ok=True)
    page.hover(f"{first} .tok.s.k-call")
    shot = ARTIFACTS / "viewer_step.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")
    assert shot.stat().st_size > 10_000
    page.close()


def test_mismatch_file_with_wrong_columns_is_one_line(page_path: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from pipeline.cli import app

    bad = tmp_path / "replay.parquet"
    pq.write_table(pa.table({"sample_id": ["x"], "position": [1]}), bad)
    run = page_path.parent  # any path: the replay file is checked before any step is read
    result = CliRunner().invoke(app, ["inspect", str(run), "--format", "html", "--mismatch", str(bad)])
    assert result.exit_code == 2 and "missing column(s) pos, delta" in result.stderr, result.output
