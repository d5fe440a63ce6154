"""pdserve on Ray Serve: `import_path: services.ray_serve:build_app` (needs `pdserve[ray]`;
nothing else in pdserve imports ray)."""

from services.ray_serve.app import build_app

__all__ = ["build_app"]
