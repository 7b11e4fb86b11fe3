"""HTTP serving: OpenAI- and Anthropic-compatible endpoints over one inference worker (`python -m tg_ds4 serve`).

Modules, one concept each: `app` (routes, limits, startup), `openai_api` / `anthropic_api` (request -> prompt, events ->
responses in each API's shape), `schemas` (request validation, also the published OpenAPI schema), `body` (size/depth
limits before parsing), `errors`, `completion` (one request's token stream turned into text pieces on the event loop),
`textstream` (detokenizing with stop strings held back), `worker` (the single inference thread and its FIFO queue),
`kvstore` (persistent prefix KV cache), `toolcalls` (tool-call markup parsed back into calls)."""
