"""gpus.health_source: what the health verdict rests on (agent, heartbeat, inventory, operator)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23

Before this the source lived only in the manager's memory and every restart reset it to "agent",
so a GPU failed by heartbeat silence before a restart stayed failed when its agent came back.
Existing rows become "agent" (what a restart assumed).
"""

from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.add_column(sa.Column('health_source', sa.String(length=16), nullable=False,
                                      server_default='agent'))


def downgrade() -> None:
    with op.batch_alter_table('gpus', schema=None) as batch_op:
        batch_op.drop_column('health_source')
