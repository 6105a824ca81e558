"""``baton gateway``: serve the OpenAI-compatible HTTP API with uvicorn."""

from __future__ import annotations

import argparse
import logging

from baton.client_commands import add_tls_flags, tls_credentials

log = logging.getLogger(__name__)

# Open SSE streams would otherwise hold a shutdown until every generation ends.
_GRACEFUL_SHUTDOWN_S = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8000, help="HTTP port to listen on (default 8000)")
    parser.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    parser.add_argument(
        "--target",
        default="127.0.0.1:50051",
        help="Baton scheduler gRPC HOST:PORT to forward to (default 127.0.0.1:50051), or several replicas "
        "(ipv4:HOST:PORT,HOST:PORT, or a name that resolves to them), across which a stream follows its "
        "request when its replica goes away",
    )
    parser.add_argument(
        "--auth-tokens-file",
        default="",
        help="YAML file mapping API keys (bearer tokens) to tenants, as the scheduler's security.auth_tokens_file "
        '("*" = admin); when set, every route but /health, /version and /metrics needs "Authorization: Bearer KEY" '
        "(or x-api-key: KEY) and the key sets the tenant (default: off; the client's key is still forwarded to the "
        "scheduler)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=None,
        help="largest request body accepted; a larger one gets 413 before it is read (default 8 MiB)",
    )
    parser.add_argument(
        "--model-alias",
        action="append",
        default=[],
        metavar="NAME",
        help="another name clients may give as `model` for the served model, e.g. a short one for a model "
        "path; repeatable. /v1/models lists it too (default: only the name the executors registered)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default="",
        choices=[
            "",
            "hermes",
            "llama3_json",
            "mistral",
            "pythonic",
            "qwen3_coder",
            "glm45",
            "glm47",
            "deepseek_v3",
            "deepseek_v31",
            "kimi_k2",
            "granite",
            "openai",
        ],
        help='serve chat tool_choice "auto" (the default once a request brings tools), reading the calls the '
        "model writes in this syntax: hermes (<tool_call>{...}</tool_call>: Hermes 2 Pro and 3, Qwen 2.5 and later), "
        'llama3_json (a JSON call, {"name", "parameters"}: Llama 3.1 and later), mistral ([TOOL_CALLS]: Mistral\'s '
        "instruct models), pythonic ([f(x=1)]: Llama 3.2 and 4's pythonic templates), qwen3_coder "
        "(<tool_call><function=f><parameter=x>: Qwen3-Coder), glm45 or glm47 (<tool_call>f<arg_key>x</arg_key>: "
        "GLM-4.5 to 4.7), deepseek_v3 or deepseek_v31 (<｜tool▁calls▁begin｜>: DeepSeek-V3, R1 and V3.1, either "
        "reads both forms), kimi_k2 (<|tool_calls_section_begin|>: Kimi K2), granite (<|tool_call|>[{...}]: "
        "IBM Granite 3 and later) or openai (gpt-oss's harmony "
        "messages to functions.NAME; needs --reasoning-parser openai_gptoss); default: none, and "
        '"auto" is a 400',
    )
    parser.add_argument(
        "--reasoning-parser",
        default="",
        choices=["", "deepseek_r1", "qwen3", "glm45", "mistral", "deepseek_v3", "kimi_k2", "openai_gptoss"],
        help="return a reasoning model's thinking (<think>...</think>) in chat answers' reasoning_content "
        "instead of their content: deepseek_r1 (R1, QwQ: an answer without </think> is all thinking), qwen3 "
        "(Qwen3 and Qwen3.5: as deepseek_r1 unless enable_thinking is false; a Qwen3-Coder call ends the "
        "thinking too), glm45 (GLM-4.5 to 4.7: an output that opens with <think> thinks until </think>, any "
        "other is all answer), mistral (as glm45, with Magistral's [THINK]...[/THINK]), "
        "deepseek_v3 (V3.1 and later: as deepseek_r1 where chat_template_kwargs switch thinking on, else all "
        "answer), kimi_k2 (as deepseek_r1 unless thinking is false; a tool-call section ends the thinking too) or "
        "openai_gptoss (gpt-oss's harmony messages: the analysis channel is the thinking); default: none",
    )
    for flag, what in (("origins", "origins (web pages) that"), ("methods", "HTTP methods"), ("headers", "headers")):
        parser.add_argument(
            f"--allowed-{flag}",
            default='["*"]',
            help=f'the {what} a browser may send cross-origin, as a JSON list, as vLLM\'s flag (default ["*"]: any)',
        )
    parser.add_argument(
        "--allow-credentials", action="store_true", help="let cross-origin requests carry cookies (default: not)"
    )
    add_tls_flags(parser)  # to the scheduler, when it serves TLS (security.tls_cert)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    parser.add_argument("--tracing", action="store_true", help="emit OpenTelemetry spans and propagate trace context")
    parser.add_argument(
        "--otlp-endpoint", default="", help="OTLP endpoint for spans (needs opentelemetry-exporter-otlp)"
    )


def run(args: argparse.Namespace) -> int:
    # Imported here so that `baton --help` and the other subcommands do not pay for the web stack.
    import uvicorn

    from common.gc_heap import freeze_startup_heap
    from common.security import load_tokens
    from common.service import setup_logging
    from common.tracing import setup_tracing
    from gateway.app import DEFAULT_MAX_BODY_BYTES, create_app
    from gateway.cors import CorsPolicy, string_list

    setup_logging(args.log_level)
    tracing = setup_tracing("baton-gateway", args.tracing, args.otlp_endpoint)
    tokens = load_tokens(args.auth_tokens_file)
    if args.auth_tokens_file and not tokens:  # an empty file must not quietly serve everyone
        log.error("%s holds no tokens; refusing to start with client auth off", args.auth_tokens_file)
        return 2
    log.info(
        "gateway on %s:%d forwarding to %s, client auth %s",
        args.host,
        args.port,
        args.target,
        f"on ({len(tokens)} keys)" if tokens else "off",
    )
    max_body = DEFAULT_MAX_BODY_BYTES if args.max_body_bytes is None else args.max_body_bytes
    if max_body < 1:
        log.error("--max-body-bytes must be >= 1")
        return 2
    try:
        origins, methods, headers = (
            string_list(flag) for flag in (args.allowed_origins, args.allowed_methods, args.allowed_headers)
        )
    except ValueError as err:
        log.error("--allowed-origins, --allowed-methods, --allowed-headers: %s", err)
        return 2
    cors = CorsPolicy(origins, methods, headers, args.allow_credentials)
    app = create_app(
        args.target,
        tracing,
        tokens,
        max_body,
        args.model_alias,
        args.tool_call_parser,
        args.reasoning_parser,
        cors,
        tls_credentials(args),
    )
    freeze_startup_heap()
    # uvicorn's loop "auto" is uvloop where it is installed, the loop the services run on (common/event_loop.py).
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
    )
    return 0
