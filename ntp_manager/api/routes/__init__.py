"""REST routes, one APIRouter per area (cluster, jobs, operations, audit, tokens, dashboard)."""
