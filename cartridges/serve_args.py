"""The command line of `cartridges-serve`, apart from the server: argparse only, so `--help` and `--version`
answer without importing torch (cartridges/cli.py) and cartridges/http.py parses the same options."""

import argparse
import os

from zoo.cli import version_line

USAGE_EPILOG = """examples:
  cartridges-serve --model smollm2-135m-instruct --cartridges runs/serve_cartridges --port 8000
  curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "Hi"}], "cartridges": [{"id": "quellmere"}]}'"""


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cartridges-serve",
        description="Serve cartridges over an OpenAI-compatible HTTP API.",
        epilog=USAGE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="known name (smollm2-135m-instruct), .gguf, HF dir, tiny-llama")
    parser.add_argument("--cartridges", required=True, help="dir of <id>.safetensors or <id>/cartridge.safetensors")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"], help="auto: bf16 on CUDA")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on CUDA (default: graphs)")
    parser.add_argument("--cache-bytes", type=int, default=4 << 30, help="LRU budget of loaded cartridges")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20)
    parser.add_argument("--max-tokens-limit", type=int, default=2048)
    parser.add_argument("--max-prompt-tokens", type=int, default=None, help="default: the model's context")
    parser.add_argument("--served-name", default="", help="model id in the API (default: --model)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("CARTRIDGES_API_KEY") or None,
        help="require 'Authorization: Bearer <key>' (default: $CARTRIDGES_API_KEY; none: no key)",
    )
    parser.add_argument("--allowed-hosts", help="Host names to accept, comma-separated; '*': any (default: loopback)")
    parser.add_argument("--timeout-keep-alive", type=int, default=5, help="close idle connections after (s)")
    parser.add_argument("--header-timeout", type=float, default=10.0, help="close connections without headers (s)")
    parser.add_argument("--body-timeout", type=float, default=30.0, help="answer 408 to a body slower than (s)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: the cores available)")
    parser.add_argument("--version", action="version", version=version_line("cartridges-serve"))
    return parser
