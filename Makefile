# The two commands (see README): `make serve` and `make test`. Both create .venv on first use.
.PHONY: env serve stop test unit integration bench

env:
	@bash scripts/setup.sh

test: env
	.venv/bin/python -m pytest tests -q -p no:cacheprovider

unit: env
	.venv/bin/python -m pytest tests/unit -q -p no:cacheprovider

serve:
	@bash scripts/serve.sh

stop:
	@bash scripts/stop.sh
