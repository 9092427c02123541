"""fleet: the outbox every manager writes agents' state changes to, and what the leader applied

Revision ID: 0007
Revises: 0005
Create Date: 2026-11-28

With `fleet_ingest` on (PostgreSQL only), every manager, standbys included, takes agent streams:
it validates a hello or report as the leader would (auth, node binding, bounds), and commits it as
an `outbox` row (idempotency key unique: a report re-sent to another manager is stored once) before
it acknowledges. The leader applies the rows in `seq` order and records the last one it applied in
`outbox_state`, in the same transaction and under the same fence (the leader epoch), so a row is
applied exactly once whoever leads. A row that cannot be applied goes to `outbox_quarantine` with
its reason (and an audit row) and never blocks the rest. `agent_commands` carries the leader's
commands to an agent whose stream another manager holds. SQLite (one manager) never uses them.
"""

from alembic import op
import sqlalchemy as sa


revision = '0007'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    big = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')
    op.create_table(
        'outbox',
        sa.Column('seq', big, primary_key=True, autoincrement=True),
        sa.Column('kind', sa.String(length=16), nullable=False),
        sa.Column('node', sa.String(length=256), nullable=False, server_default=''),
        sa.Column('report_seq', sa.BigInteger(), nullable=True),
        sa.Column('payload', sa.JSON(), nullable=False),
        sa.Column('idem_key', sa.String(length=320), nullable=False),
        sa.Column('manager', sa.String(length=256), nullable=False, server_default=''),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint('idem_key', name='uq_outbox_idem_key'),
    )
    op.create_index('ix_outbox_node_report_seq', 'outbox', ['node', 'report_seq'])
    op.create_table(
        'outbox_state',
        sa.Column('consumer', sa.String(length=64), primary_key=True),
        sa.Column('last_seq', sa.BigInteger(), nullable=False),
        sa.Column('epoch', sa.BigInteger(), nullable=False),
        sa.Column('applied_at', sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        'outbox_quarantine',
        sa.Column('seq', sa.BigInteger(), primary_key=True),
        sa.Column('reason', sa.Text(), nullable=False),
        sa.Column('epoch', sa.BigInteger(), nullable=False),
        sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        'agent_commands',
        sa.Column('id', big, primary_key=True, autoincrement=True),
        sa.Column('node', sa.String(length=256), nullable=False),
        sa.Column('payload', sa.JSON(), nullable=False),
        sa.Column('epoch', sa.BigInteger(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index('ix_agent_commands_node', 'agent_commands', ['node', 'id'])


def downgrade() -> None:
    op.drop_index('ix_agent_commands_node', table_name='agent_commands')
    op.drop_table('agent_commands')
    op.drop_table('outbox_quarantine')
    op.drop_table('outbox_state')
    op.drop_index('ix_outbox_node_report_seq', table_name='outbox')
    op.drop_table('outbox')
