"""A scripted OpenAI-compatible chat server on 127.0.0.1, the only mock in the tests: it stands at
the network edge, where a real vLLM or commercial endpoint would be."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def usage_of(body: dict, text: str) -> dict:
    prompt = sum(len(m["content"].split()) for m in body["messages"])
    return {"prompt_tokens": prompt, "completion_tokens": len(text.split()), "total_tokens": prompt + len(text.split())}


class FakeOpenAIServer:
    """Answers /v1/chat/completions from a script. Each entry is a message text, or a fault:
    {"status": 500} an error response (with "retry_after": seconds, a Retry-After header),
    {"hang": seconds} no answer for that long (then "text", if given), {"truncated": True} a body
    cut short of its Content-Length, {"text": ..., "usage": False} an answer without usage (some servers),
    {"raw": text, "content_type": ...} a 200 whose body is that text (not OpenAI's JSON; also `models_raw`
    for the model listing), {"choices": []} a completion without choices, {"text": ..., "finish_reason": "length"}
    an answer cut at the request's max_tokens. Every request body is kept in
    `requests` (its Authorization header in `keys`), the model listings answered are counted in `listings`, and
    the most chat requests in flight at once is `most_at_once`. Answers report token usage as a server does, counting whitespace-separated words (`usage_of`)."""

    def __init__(self, script=(), models=("sim-model",), default=None, respond=None, models_raw=None):
        self.respond = respond  # called with each request body once the script is used up: an entry as above
        self.script = list(script)
        self.models = list(models)
        self.models_raw = models_raw  # a (text, content type) answer to the model listing instead of the list
        self.default = default  # answer once the script is used up (None: fail the test loudly)
        self.requests, self.keys = [], []
        self.listings = self.in_flight = self.most_at_once = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, body, headers=(), truncated=False, raw=None, content_type="application/json"):
                data = raw.encode() if raw is not None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers:
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data[:len(data) // 2] if truncated else data)
                if truncated:
                    self.close_connection = True

            def do_GET(self):
                if self.path.rstrip("/").endswith("/models"):
                    with server._lock:
                        server.listings += 1
                if self.path.rstrip("/").endswith("/models") and server.models_raw:
                    self._send(200, None, raw=server.models_raw[0], content_type=server.models_raw[1])
                elif self.path.rstrip("/").endswith("/models"):
                    self._send(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in server.models]})
                else:
                    self._send(404, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server._lock:
                    server.requests.append(body)
                    server.keys.append(self.headers.get("Authorization"))
                    server.in_flight += 1
                    server.most_at_once = max(server.most_at_once, server.in_flight)
                try:
                    self._answer(body)
                finally:
                    with server._lock:
                        server.in_flight -= 1

            def _answer(self, body):
                with server._lock:
                    entry = server.script.pop(0) if server.script else (
                        server.respond(body) if server.respond else server.default)
                if isinstance(entry, dict) and "hang" in entry:
                    time.sleep(entry["hang"])
                    entry = entry.get("text")
                    if entry is None:
                        return  # the client has given up by now; close without an answer
                if entry is None:
                    self._send(500, {"error": {"message": "fake server: script exhausted"}})
                elif isinstance(entry, dict) and "raw" in entry:
                    self._send(200, None, raw=entry["raw"], content_type=entry.get("content_type", "application/json"))
                elif isinstance(entry, dict) and "choices" in entry:
                    self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                                     "choices": entry["choices"]})
                elif isinstance(entry, dict) and "status" in entry:
                    headers = [("Retry-After", str(entry["retry_after"]))] if "retry_after" in entry else []
                    self._send(entry["status"], {"error": {"message": f"scripted {entry['status']}"}}, headers)
                else:
                    text = entry["text"] if isinstance(entry, dict) else entry
                    self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                                     "choices": [{"index": 0, "finish_reason": entry.get("finish_reason", "stop")
                                                  if isinstance(entry, dict) else "stop",
                                                  "message": {"role": "assistant", "content": text}}],
                                     **({} if isinstance(entry, dict) and entry.get("usage") is False
                                        else {"usage": usage_of(body, text)})},
                               truncated=isinstance(entry, dict) and entry.get("truncated", False))

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 256  # the default backlog (5) refuses connections when many calls start at once

            def handle_error(self, request, client_address):
                pass  # a client that gave up on a hanging answer leaves a broken pipe: expected here

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        # A short poll: shutdown() waits up to one poll interval (0.5 s by default) for the loop to notice.
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
