"""`python -m gateway`: serve the app with uvicorn until SIGTERM, then drain."""

from __future__ import annotations

import logging

import uvicorn

from gateway.app import create_app
from gateway.config import config_from_args


def main() -> None:
    config = config_from_args()
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        timeout_graceful_shutdown=int(config.drain_timeout_s),
    )


if __name__ == "__main__":
    main()
