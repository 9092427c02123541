"""fleet: each manager's backlog, so that balance sends no clients to one that is behind

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-29

Every manager also writes, beside the streams it holds, how many rows of work it has queued: the
reports and hellos waiting for its group commit and, on the leader, the outbox rows stored and not
applied yet. A manager publishing more than `fleet_balance_busy_rows` is sent no clients until it
has caught up (service/leadership/balance.py): at 12,500 agents on a 2-core VM the standbys kept sending
agents to a leader that was applying their hellos and could not welcome them in time.
"""

from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('fleet_members', sa.Column('backlog', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    op.drop_column('fleet_members', 'backlog')
