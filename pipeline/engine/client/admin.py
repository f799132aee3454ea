"""Admin calls of the engine client: fanned out to every server at once, failures named per server.

A mixin of `EngineClient` (kept apart so each module stays readable); it uses the client's URL
list and HTTP session.
"""

from __future__ import annotations

import abc
import asyncio
import uuid
from collections.abc import Callable
from typing import Any, Literal

import aiohttp

from pipeline.engine.client.wire import EngineError, json_or_text, parse_weight_version, raise_for_status
from schemas.engine_api import VERIFY_RID_PREFIX

_ADMIN_TIMEOUT_S = 600.0  # weight loads can be slow on a big model
_CONNECTION_ERRORS = (aiohttp.ClientConnectionError, ConnectionError)


class AdminCalls(abc.ABC):
    """Admin fan-out mixed into `EngineClient`, which provides the server list and the HTTP session."""

    _url_source: list[str] | Callable[[], list[str]]
    _servers: dict[str, Any]
    admin_timeout_s: float = _ADMIN_TIMEOUT_S
    """Deadline of each admin call (the trainer's publisher sets `trainer.publish_timeout_s`)."""

    @abc.abstractmethod
    def _refresh_urls(self) -> None: ...

    @abc.abstractmethod
    def _http(self) -> aiohttp.ClientSession: ...

    # -- admin fan-out ------------------------------------------------------------------------
    async def model_info(self) -> dict[str, Any]:
        """`/model_info` of the first server that answers."""
        errors = []
        for url in self._admin_urls():
            try:
                return await self._admin(url, "GET", "/model_info")
            except EngineError as exc:
                errors.append(f"{url}: {exc}")
        raise EngineError(f"no server answered /model_info: {errors}")

    async def weight_version(self) -> int:
        """The lowest weight version over the servers that answer (what every live server has at least).

        SGLang reports it as `weight_version` in `/model_info` (it has no route of its own). A registry
        entry of a server that died (SIGKILL, a lost node) must not stop the rollout while a live server
        serves; only when no server answers is it an error (naming every one).
        """
        urls = self._admin_urls()
        results = await asyncio.gather(*(self._admin(u, "GET", "/model_info") for u in urls), return_exceptions=True)
        versions = [parse_weight_version(r.get("weight_version")) for r in results if isinstance(r, dict)]
        if not versions:
            detail = "; ".join(f"{u}: {r}" for u, r in zip(urls, results, strict=True)) or "no servers known"
            raise EngineError(f"/model_info failed on every server: {detail}", server=",".join(urls))
        return min(versions)

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> None:
        """Every server reloads its weights from `model_path` (a Hugging Face dir) and reports `weight_version`."""
        body = {"model_path": str(model_path), "weight_version": str(weight_version)}
        await self._fan_out("POST", "/update_weights_from_disk", body)

    async def server_tp_sizes(self) -> dict[str, int]:
        """Tensor-parallel size of each server (`/server_info`), in routing order."""
        answers = await self._fan_out("GET", "/server_info", None)
        return {url: int(answers[url].get("tp_size", 1) or 1) for url in self._admin_urls()}

    async def weights_group_world_size(self) -> int:
        """World size of the broadcast group: the trainer (rank 0) + every server's TP ranks.

        The trainer needs it before it joins the group, i.e. before `init_weights_update_group`
        returns (every rank blocks until all have joined).
        """
        return 1 + sum((await self.server_tp_sizes()).values())

    async def init_weights_update_group(
        self, master_address: str, master_port: int, group_name: str, backend: str
    ) -> int:
        """Ask every server to join the broadcast group; server i's ranks start at 1 + sum(tp of servers < i).

        Returns the world size. The trainer must join as rank 0 concurrently (this call completes
        only when every rank has joined).
        """
        sizes = await self.server_tp_sizes()
        world_size = 1 + sum(sizes.values())
        offsets, next_rank = {}, 1
        for url, tp in sizes.items():
            offsets[url], next_rank = next_rank, next_rank + tp
        bodies = {
            url: {
                "master_address": master_address,
                "master_port": int(master_port),
                "rank_offset": offsets[url],
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            }
            for url in sizes
        }
        await self._fan_out("POST", "/init_weights_update_group", bodies)
        return world_size

    async def begin_weight_update(self) -> None:
        """Every server opens a weight-update session (SGLang refuses `update_weights_from_distributed`
        outside one, and a second begin before `end_weight_update`)."""
        await self._fan_out("POST", "/begin_weight_update", {})

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        weight_version: int | None,
        *,
        flush_cache: bool = True,
    ) -> None:
        """Every server receives the named tensors from the group's rank 0 (broadcast in `names` order).

        Only inside a session (`begin_weight_update` ... `end_weight_update`). A server records
        `weight_version` as soon as this call loads (None: keeps its version), and with `flush_cache`
        (SGLang's default) flushes its cache after the load, which SGLang refuses (the call fails, the
        weights loaded) while any request holds KV cache: send the version and the flush with the last
        bucket of a version only, with generation paused in mode `retract`.
        """
        body: dict[str, Any] = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        await self._fan_out("POST", "/update_weights_from_distributed", body)

    async def end_weight_update(self) -> None:
        """Every server closes its weight-update session (SGLang finalises the loaded weights here)."""
        await self._fan_out("POST", "/end_weight_update", {})

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Every server leaves the broadcast group `group_name` (frees the group and its name there)."""
        await self._fan_out("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def pause_generation(self, mode: Literal["in_place", "retract", "abort", "wait"] = "in_place") -> None:
        """Every server stops scheduling decode steps (requests in flight wait, they are not dropped).

        `in_place` keeps their KV cache; `retract` sends them back to the queue (their cache is
        recomputed on continue, so a flush may follow: what a weight update needs). `wait` (arl's engines;
        SGLang refuses it) lets the requests in flight finish first and returns once none runs.
        """
        await self._fan_out("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self._fan_out("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._fan_out("POST", "/flush_cache", None)

    # -- per-server calls (the publisher decides server by server) -------------------------------
    async def call_each(
        self, urls: list[str], method: str, path: str, body: Any = None, *, timeout_s: float | None = None
    ) -> dict[str, dict[str, Any] | EngineError]:
        """Call `path` on each of `urls` at once; each server's answer or its `EngineError` (never raises).

        `body` may map each URL to its own body; `timeout_s` replaces `admin_timeout_s` for these calls."""
        results = await self._each(urls, method, path, body, timeout_s)
        for result in results.values():
            if isinstance(result, BaseException) and not isinstance(result, EngineError):
                raise result  # not a server's answer: a bug to see, not a failure to report
        return {u: r for u, r in results.items() if isinstance(r, dict | EngineError)}

    async def score_prompt(self, url: str, input_ids: list[int], *, lora_path: str | None = None) -> list[Any]:
        """SGLang's `meta_info.input_token_logprobs` of `input_ids` on one server: [logprob, id, text] per
        position, the first logprob null (nothing precedes it). Nothing is generated (`max_new_tokens: 0`)
        and the `rid` marks it as the trainer's probe: arl's engines run it while generation is paused. `lora_path`:
        the LoRA adapter that scores it (None: the served weights alone)."""
        body: dict[str, Any] = {
            "input_ids": list(input_ids),
            "return_logprob": True,
            "logprob_start_len": 0,
            "rid": f"{VERIFY_RID_PREFIX}{uuid.uuid4().hex}",
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
        }
        if lora_path is not None:
            body["lora_path"] = lora_path
        answer = await self._admin(url, "POST", "/generate", body)
        scored = (answer.get("meta_info") or {}).get("input_token_logprobs")
        if not isinstance(scored, list):
            raise EngineError(f"{url}/generate: no meta_info.input_token_logprobs in {str(answer)[:200]}", server=url)
        return scored

    async def weights_by_name(self, url: str, name: str, truncate_size: int) -> list[Any]:
        """SGLang's `/get_weights_by_name`: the first `truncate_size` rows of parameter `name` as float32 lists."""
        answer = await self._admin(url, "POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})
        rows = answer.get("result") if isinstance(answer, dict) and set(answer) == {"result"} else answer
        if not isinstance(rows, list):
            raise EngineError(f"{url}/get_weights_by_name {name}: expected a list, got {str(answer)[:200]}", server=url)
        return rows

    async def served_version(self, url: str) -> int:
        """The weight version one server reports in `/model_info`."""
        answer = await self._admin(url, "GET", "/model_info")
        return parse_weight_version(answer.get("weight_version"))

    def _admin_urls(self) -> list[str]:
        if callable(self._url_source):
            self._refresh_urls()
        if not self._servers:
            raise EngineError("no inference servers known: is the inference stage running?")
        return list(self._servers)

    async def _fan_out(self, method: str, path: str, body: Any) -> dict[str, dict[str, Any]]:
        """Call `path` on every server at once; raise one error naming every server that failed."""
        urls = self._admin_urls()
        results = await self._each(urls, method, path, body, None)
        failed = {u: r for u, r in results.items() if isinstance(r, BaseException)}
        if failed:
            detail = "; ".join(f"{u}: {e}" for u, e in failed.items())
            statuses = {e.status for e in failed.values() if isinstance(e, EngineError)}
            status = statuses.pop() if len(statuses) == 1 else None
            raise EngineError(
                f"{path} failed on {len(failed)} of {len(urls)} servers: {detail}",
                status=status,
                server=",".join(failed),
            )
        return {u: r for u, r in results.items() if isinstance(r, dict)}

    async def _each(
        self, urls: list[str], method: str, path: str, body: Any, timeout_s: float | None
    ) -> dict[str, dict[str, Any] | BaseException]:
        """`path` on every server at once (`body` may map each URL to its own): each answer or exception."""
        per_url = body if isinstance(body, dict) and urls and set(body) == set(urls) else None

        async def one(url: str) -> dict[str, Any]:
            return await self._admin(url, method, path, per_url[url] if per_url else body, timeout_s=timeout_s)

        results = await asyncio.gather(*(one(u) for u in urls), return_exceptions=True)
        return dict(zip(urls, results, strict=True))

    async def _admin(
        self, url: str, method: str, path: str, body: Any = None, *, timeout_s: float | None = None
    ) -> dict[str, Any]:
        deadline_s = self.admin_timeout_s if timeout_s is None else timeout_s
        try:
            async with asyncio.timeout(deadline_s):
                async with self._http().request(method, f"{url}{path}", json=body) as resp:
                    await raise_for_status(resp, url)
                    text = await resp.text()
        except _CONNECTION_ERRORS as exc:
            raise EngineError(f"{url}{path}: {type(exc).__name__}: {exc}", server=url) from exc
        except TimeoutError:
            raise EngineError(f"{url}{path} timed out after {deadline_s:.0f}s", server=url) from None
        data = json_or_text(text)
        if isinstance(data, dict) and data.get("success") is False:
            raise EngineError(f"{url}{path}: {data.get('message', data)}", status=resp.status, server=url)
        return data if isinstance(data, dict) else {"result": data}
