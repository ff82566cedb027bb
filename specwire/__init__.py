"""specwire: speculative decoding served as two gRPC microservices (a target and a drafter),
with an OpenAI-compatible gateway. Subpackages: `common` (model, tokenizer, client, drafting
contract, transport), `target_service`, `drafter_service`, `gateway`; `v1` holds the gRPC stubs
generated from protos/ (`make protos`)."""
