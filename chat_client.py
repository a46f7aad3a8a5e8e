"""The OpenAI-compatible chat client: the LLM simulated user's endpoint (llm_user.py) and the tested model's in
both evaluations. One client (one connection pool) serves every dialogue; it retries within a bound, says when an
endpoint is slow, checks at start-up that the endpoint serves the model, and counts its calls (common.CallStats).
"""
import asyncio
import contextvars
import math
import os
import sys
import time

import common
import guards

_CURRENT_CALL = contextvars.ContextVar("current_simulator_call")  # the common.CallStats an HTTP attempt counts into
CHECK_TIMEOUT = 10.0  # seconds a start-up model listing may take (an endpoint that never answers fails then)
# What the SDK raises on an answer that is not its JSON: not JSON (ValueError), an HTML page parsed as
# text (AttributeError), JSON of another shape (pydantic's ValidationError is a ValueError).
NOT_OPENAI_JSON = (ValueError, AttributeError, TypeError)
RETRY_NOTICE_EVERY = 60.0  # seconds between two notices of a client's retries or waits
WAIT_NOTICE_AFTER = 10.0  # seconds a call may go unanswered before the wait is said


class ChatClient:
    """Chat completions from an OpenAI-compatible endpoint (vLLM `serve`, commercial APIs). One client
    (one connection pool) serves every dialogue; `totals` counts its traffic."""

    def __init__(self, base_url: str, model: str, api_key_env: str = "OPENAI_API_KEY",
                 temperature: float | None = None, max_tokens: int | None = None, timeout: float = 120.0,
                 max_retries: int = 3, role: str = "simulator", whole_answers: bool = False,
                 top_p: float | None = None):
        """`temperature`, `top_p`, `max_tokens`: sent when not None (else the server's own). `whole_answers`: an answer
        cut at max_tokens (finish_reason "length") is a failed call, never an answer: a simulated user's
        reply cut before its `Response:` would otherwise become the user's whole message."""
        import openai

        if not guards.is_url(base_url):
            raise common.InputError(f"the {role} endpoint's address {base_url}: must be {guards.URL[1]}")
        # Local servers (vLLM) accept any key; commercial APIs need the named variable set.
        api_key = os.environ.get(api_key_env) or "EMPTY"
        if api_key == "EMPTY" and api_key_env != "OPENAI_API_KEY":  # a variable named on purpose, left unset
            print(f"note: ${api_key_env} is not set: the {role} endpoint {base_url} gets no API key", file=sys.stderr)
        # The SDK retries connection errors, timeouts, 429 (after its Retry-After) and 5xx, at most
        # max_retries times, with exponential back-off and jitter; the hook counts its attempts.
        http_client = openai.DefaultAsyncHttpxClient(event_hooks={"request": [self._count_attempt]})
        self.client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout, max_retries=max_retries,
                                         http_client=http_client)
        self.base_url, self.model, self.role = base_url, model, role  # role names the endpoint in errors
        self.temperature, self.top_p, self.max_tokens = temperature, top_p, max_tokens
        self.whole_answers = whole_answers
        self.timeout, self.max_retries = timeout, max_retries
        self.totals = common.CallStats()
        self.retry_said_at = -math.inf  # when a retry was last said (time.monotonic)

    async def _count_attempt(self, _request) -> None:
        """httpx request hook: every attempt the SDK sends, retries included, in the task making the call. A
        retry is said (at most once a minute): an endpoint that never answers would otherwise leave the script
        silent for timeout x (max_retries + 1) seconds."""
        stats = _CURRENT_CALL.get(None)
        if stats is None:
            return
        stats.attempts += 1
        if stats.attempts > 1 and time.monotonic() - self.retry_said_at >= RETRY_NOTICE_EVERY:
            self.retry_said_at = time.monotonic()
            print(f"the {self.role} endpoint {self.base_url} failed a call or left it unanswered for "
                  f"{self.timeout:g} s; retrying (attempt {stats.attempts} of {self.max_retries + 1})",
                  file=sys.stderr, flush=True)

    def _say_waiting(self) -> None:
        """A call unanswered for WAIT_NOTICE_AFTER seconds is said (at most once a minute), with its bound."""
        if time.monotonic() - self.retry_said_at >= RETRY_NOTICE_EVERY:
            self.retry_said_at = time.monotonic()
            print(f"waiting for the {self.role} endpoint {self.base_url}: a call unanswered for "
                  f"{WAIT_NOTICE_AFTER:g} s (each try is given up after {self.timeout:g} s, and retried "
                  f"{self.max_retries} times)", file=sys.stderr, flush=True)

    async def check(self) -> None:
        """Fail early, with what to check, when the endpoint cannot serve this model."""
        import openai

        seconds = min(self.timeout, CHECK_TIMEOUT)
        try:  # one retry, not the calls' back-off: a start-up check should answer in a second or two
            models = [m.id async for m in self.client.with_options(max_retries=1, timeout=seconds).models.list()]
        except openai.APITimeoutError:
            raise common.EndpointError(f"the {self.role} endpoint {self.base_url} did not answer a model listing in "
                                       f"{seconds:g} s, twice; check that the server is up and not overloaded"
                                       ) from None
        except openai.APIConnectionError as error:
            raise common.EndpointError(f"cannot reach the {self.role} endpoint {self.base_url} ({error}); "
                                       "check the base URL and that the server is running") from None
        except openai.AuthenticationError:
            raise common.EndpointError(f"the {self.role} endpoint {self.base_url} refused the API key; "
                                       "check the variable named by the api_key_env option") from None
        except openai.APIStatusError as error:
            raise common.EndpointError(f"the {self.role} endpoint {self.base_url} answered {error.status_code} "
                                       f"to a model listing: {error.message}") from None
        except NOT_OPENAI_JSON as error:
            raise common.EndpointError(f"the {self.role} endpoint {self.base_url} answered a model listing with "
                                       f"something that is not OpenAI's JSON ({type(error).__name__}); check that the "
                                       "base URL is an OpenAI-compatible API (it usually ends in /v1)") from None
        if models and self.model not in models:
            raise common.EndpointError(f"model {self.model!r} is not served at {self.base_url}; it serves {models}")

    async def complete(self, messages: list[dict], seed: int | None = None,
                       stats: common.CallStats | None = None) -> str:
        """The model's answer; the call is counted in `totals` and, if given, in `stats` (a dialogue's)."""
        import openai

        call = common.CallStats(calls=1)
        token = _CURRENT_CALL.set(call)
        notice = asyncio.get_running_loop().call_later(WAIT_NOTICE_AFTER, self._say_waiting)
        try:
            settings = {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens,
                        "seed": seed}
            response = await self.client.chat.completions.create(
                model=self.model, messages=messages,
                **{name: value for name, value in settings.items() if value is not None})
            if response.usage is not None:
                call.prompt_tokens = response.usage.prompt_tokens or 0
                call.completion_tokens = response.usage.completion_tokens or 0
            if not response.choices:
                call.failed = 1
                raise common.EndpointError(f"{self.role} endpoint {self.base_url} answered a chat completion without "
                                           "choices")
            if self.whole_answers and response.choices[0].finish_reason == "length":
                call.failed = 1
                raise common.EndpointError(f"{self.role} endpoint {self.base_url} cut its answer at max_tokens "
                                           f"{self.max_tokens} (finish_reason length); raise --simulator_max_tokens")
            if response.choices[0].message.content is None:  # a tool call, or a reasoning server's answer
                call.failed = 1
                raise common.EndpointError(f"{self.role} endpoint {self.base_url} answered a chat completion without "
                                           "content (a tool call, or only reasoning?); serve the model so that it "
                                           "answers in text")
            return response.choices[0].message.content
        except openai.APIError as error:
            call.failed = 1
            raise common.EndpointError(f"{self.role} endpoint {self.base_url} failed after retries: {error}") from None
        except NOT_OPENAI_JSON as error:
            call.failed = 1
            raise common.EndpointError(f"{self.role} endpoint {self.base_url} answered with something that is not an "
                                       f"OpenAI chat completion ({type(error).__name__}: {error})") from None
        finally:
            notice.cancel()
            _CURRENT_CALL.reset(token)
            call.add_to(self.totals, stats)
