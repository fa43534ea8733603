"""The HTTP front door: OpenAI Chat Completions / Completions / Models, Anthropic Messages and the Responses
API, translated into the router's own gRPC API (see docs/http.md)."""
