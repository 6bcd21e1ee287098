"""OpenAI chat requests with an image, to a vLLM server: a Service or pod on the one-node
cluster (tests/cluster, scripts/try-on-cluster) or a local process.

``chat(url, model, text, image_seed)`` sends one user turn (a 224x224 PNG of random pixels
drawn from ``image_seed``, then ``text``) with greedy decoding and returns an ``Answer``:
the text and the prompt tokens vLLM reports, among them the cached ones (vLLM's
``usage.prompt_tokens_details.cached_tokens``, with ``--enable-prompt-tokens-details``: with
vLLM's own prefix cache off, the tokens the kvtier connector loaded from the tier).

    python -m kvtier.testing.chat http://10.96.12.34:8000 kvtier-test/tiny-qwen2.5-vl --repeat 2
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from dataclasses import dataclass
from typing import Any

from kvtier.testing.servers import png_data_url
from kvtier.testing.tinymodels import prompt_text

TIMEOUT_S = 300.0  # a CPU engine on a loaded 2-core machine


@dataclass(frozen=True)
class Answer:
    text: str
    prompt_tokens: int
    cached_tokens: int


def chat_body(model: str, text: str, image_seed: int, max_tokens: int = 8) -> dict[str, Any]:
    content = [
        {"type": "image_url", "image_url": {"url": png_data_url(image_seed)}},
        {"type": "text", "text": text},
    ]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def chat(
    url: str,
    model: str,
    text: str,
    image_seed: int,
    *,
    max_tokens: int = 8,
    timeout_s: float = TIMEOUT_S,
) -> Answer:
    """One chat turn against ``url`` (``http://host:port``); raises on any HTTP error."""
    body = json.dumps(chat_body(model, text, image_seed, max_tokens)).encode()
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        reply = json.loads(response.read())
    usage = reply["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return Answer(
        text=reply["choices"][0]["message"]["content"],
        prompt_tokens=int(usage["prompt_tokens"]),
        cached_tokens=int(details.get("cached_tokens") or 0),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.testing.chat", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("url", help="the engine: http://HOST:PORT")
    parser.add_argument("model", help="the served model name (the recipe's spec.model.repo)")
    parser.add_argument(
        "--words", type=int, default=400, help="words of text after the image (default 400)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="the image's and the text's seed (default 0)"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="send the same request this many times"
    )
    args = parser.parse_args(argv)
    text = prompt_text(args.words, seed=args.seed)
    for i in range(args.repeat):
        answer = chat(args.url, args.model, text, args.seed)
        print(
            f"request {i + 1}: {answer.prompt_tokens} prompt tokens, {answer.cached_tokens} cached "
            f"(served from the tier), answer {answer.text!r}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
