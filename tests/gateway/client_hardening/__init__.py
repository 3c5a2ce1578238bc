"""No client can take a server down: each attack against both servers (the gateway with a mock
upstream, the engine on a fake core), the answer it gets, and a valid request right after.

Covers compressed bodies under the decoded-size limit, strict JSON (lone surrogates, deep
nesting), Expect handling, deadlines for slow heads, slow bodies and idle connections, and the
connection caps (common/http_server.py, common/connections.py, common/request_body.py)."""
