#!/bin/sh
# pip install inside an image build: prefers the wheels bound at /opt/wheels, trusts the
# build's extra CA (the secret extra-ca, e.g. a TLS-intercepting proxy's) on top of the base's
# bundle for these downloads only, and leaves nothing of either behind. Arguments go to pip.
set -eu
if [ -s /run/secrets/extra-ca ]; then
    bundle=$(mktemp)
    cat /etc/ssl/certs/ca-certificates.crt /run/secrets/extra-ca > "$bundle"
    export PIP_CERT="$bundle"
fi
# TORCH_INDEX (a build argument): an extra index for torch's builds; empty, none.
python -m pip install --progress-bar off --find-links /opt/wheels ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} "$@"
rm -f "${bundle:-}"
