"""fleet: the managers alive and the streams each holds, for balance

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-28

With `fleet_ingest` on, every manager holds agent streams and worker layout watches. Each one
writes its row here every heartbeat period: its gRPC address and how many agents and watches it
holds. A manager holding more than its share (the streams of the managers seen lately, divided by
their number) tells some of its clients to move to the one holding the fewest
(service/leadership/balance.py). SQLite (one manager) never writes it.
"""

from alembic import op
import sqlalchemy as sa


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'fleet_members',
        sa.Column('manager', sa.String(length=256), primary_key=True),
        sa.Column('grpc_address', sa.String(length=512), nullable=False, server_default=''),
        sa.Column('agents', sa.Integer(), nullable=False, server_default='0'),
        sa.Column('watchers', sa.Integer(), nullable=False, server_default='0'),
        sa.Column('seen_at', sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('fleet_members')
