"""leader: a lease (expires_at) and the leader's addresses, for several managers on PostgreSQL

Revision ID: 0005
Revises: 0006 (0005 and 0006 were written in parallel; this one goes last)
Create Date: 2026-11-23

The `leader` row was bumped by every manager start. With several managers on one PostgreSQL
database it becomes a lease: a manager leads while `expires_at` (server time) lies ahead and it
keeps renewing; a standby takes the row over once it has expired, bumping the epoch (the fencing
token every write transaction checks). The addresses tell clients of a standby where the leader
is. The row is created here, so managers that start at the same moment only ever race on one
conditional UPDATE, never on an INSERT.
"""

from datetime import UTC, datetime

from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('leader', schema=None) as batch_op:
        batch_op.add_column(sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('http_address', sa.String(length=512), nullable=False, server_default=''))
        batch_op.add_column(sa.Column('grpc_address', sa.String(length=512), nullable=False, server_default=''))
    leader = sa.table('leader', sa.column('id', sa.Integer), sa.column('epoch', sa.BigInteger),
                      sa.column('holder', sa.String), sa.column('since', sa.DateTime(timezone=True)))
    conn = op.get_bind()
    if conn.execute(sa.select(leader.c.id).where(leader.c.id == 1)).first() is None:
        op.bulk_insert(leader, [{'id': 1, 'epoch': 0, 'holder': '', 'since': datetime.now(UTC)}])


def downgrade() -> None:
    with op.batch_alter_table('leader', schema=None) as batch_op:
        batch_op.drop_column('grpc_address')
        batch_op.drop_column('http_address')
        batch_op.drop_column('expires_at')
