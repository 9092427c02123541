"""fleet: the world log the leader writes in every state-changing transaction, for warm standbys

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06

The leader appends one `world_log` row per transaction that changes the world (GPUs, nodes,
domains, jobs, layouts), in that transaction and under its fence: the new values of every GPU and
node it wrote, the domains it added and the names of the jobs whose row or layout changed. The
leader's transactions are serialised (one write lock), so `seq` order is commit order. Every other
manager follows the log into its own copy of the world (service/leadership/follow.py); a new
leader applies what it had not applied yet instead of loading the world. Rows are pruned after
`fleet_outbox_retention_s` as the outbox's are. SQLite (one manager) never writes it.
"""

from alembic import op
import sqlalchemy as sa


revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    big = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')
    op.create_table(
        'world_log',
        sa.Column('seq', big, primary_key=True, autoincrement=True),
        sa.Column('epoch', sa.BigInteger(), nullable=False),
        sa.Column('body', sa.JSON(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('world_log')
